"""`kvpop train-model`: train the embedded default model on the task mix.

A small Llama-architecture model, trained from scratch with AdamW, a short
warmup and a length curriculum that advances on measured accuracy (a
sequence counts as solved when every solution token is the argmax under
teacher forcing, which is exactly when greedy decoding gets it right).
Resumable (`--resume`), logs a CSV and `training_curve.png`, and exports the
model in Hugging Face layout after every checkpoint.
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import time
from collections import deque
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpop.tasks.suite import FAMILIES
from kvpop.tasks.vocab import BOS_ID, EOS_ID, WORDS, save_tokenizer
from kvpop.training.data import COPY, make_batch
from kvpop.training.forward import hidden_states

# Max training lengths per curriculum stage; a batch's length is drawn from [max/2, max].
STAGES = [96, 160, 256, 384, 512, 768, 1024, 1344]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/default_model", help="checkpoint, logs and exported model folder")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--minutes", type=float, default=110.0, help="wall-clock training budget")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ff", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--tokens-per-batch", type=int, default=2048)
    p.add_argument("--advance-at", type=float, default=0.9, help="solved fraction (every family) that advances the curriculum")
    p.add_argument("--patience", type=int, default=400, help="steps after which a stage may advance on the mean solved fraction")
    p.add_argument("--decay-frac", type=float, default=0.15, help="final fraction of --minutes with a linear LR decay")
    p.add_argument("--window", type=int, default=64, help="sequences per family the solved fraction is measured over")
    p.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copy-aux", type=int, default=1, help="1: add the training-only copy sequences to every batch")
    p.add_argument("--export", default=None, help="also save the final model here (e.g. models/default)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slower steps, no compile wait)")


def model_config(args):
    from services.compute.model.config import ModelConfig
    return ModelConfig(
        architecture="llama", vocab_size=len(WORDS), hidden_size=args.hidden, intermediate_size=args.ff,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        extra={"kvpop_tasks": list(FAMILIES)})


def init_weights(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def export(model, out: Path, meta: dict) -> Path:
    from services.compute.model.loader import save_model
    tok = save_tokenizer(out / "tokenizer.json")
    dest = save_model(model, out / "model", tok)
    (dest / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    return dest


def plot_curve(log_path: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = list(csv.DictReader(log_path.open()))
    if not rows:
        return
    step = [int(r["step"]) for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(step, [float(r["loss"]) for r in rows])
    a1.set_yscale("log"); a1.set_xlabel("step"); a1.set_ylabel("loss (answer tokens)")
    ax = a1.twinx(); ax.plot(step, [int(r["stage_len"]) for r in rows], "k:", lw=1); ax.set_ylabel("curriculum max length")
    for fam in FAMILIES:
        a2.plot(step, [float(r[f"solved_{fam}"]) for r in rows], label=fam)
    a2.set_xlabel("step"); a2.set_ylabel("solved (greedy-exact, train batches)"); a2.set_ylim(0, 1.02); a2.legend()
    fig.tight_layout(); fig.savefig(png, dpi=90); plt.close(fig)


def run(args) -> int:
    from services.compute.model.model import TransformerModel
    torch.set_num_threads(args.threads)
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path = out / "checkpoint.pt", out / "training_log.csv"
    dev = torch.device(args.device)
    model = TransformerModel(model_config(args))
    init_weights(model, args.seed)
    model.to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    state = {"step": 0, "stage": 0, "elapsed": 0.0, "rng": None}
    solved = {f: deque(maxlen=args.window) for f in FAMILIES}
    if args.resume and ckpt_path.is_file():
        ck = torch.load(ckpt_path, map_location=dev, weights_only=False)
        model.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"])
        state = ck["state"]
        for f, v in ck["solved"].items():
            solved[f].extend(v)
        print(f"resumed at step {state['step']} stage {state['stage']} ({state['elapsed'] / 60:.1f} min trained)")
    elif log_path.exists():
        log_path.unlink()
    rng = random.Random(args.seed * 7919 + state["step"])
    families = list(FAMILIES)
    copy_rate = deque(maxlen=args.window)
    new_log = not log_path.exists()
    logf = log_path.open("a", newline="")
    writer = csv.writer(logf)
    if new_log:
        writer.writerow(["step", "elapsed_s", "loss", "lr", "stage_len"] + [f"solved_{f}" for f in families])
    from tqdm import tqdm
    t0, last_ck = time.time() - state["elapsed"], time.time()
    bar = tqdm(total=args.max_steps, initial=state["step"], desc="train", dynamic_ncols=True, mininterval=5)
    model.train()
    loss_ema = None
    forward = hidden_states if args.no_compile else torch.compile(hidden_states, dynamic=True)

    def save():
        state["elapsed"] = time.time() - t0
        part = Path(f"{ckpt_path}.part")   # a kill mid-write keeps the previous resumable checkpoint
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                    "solved": {f: list(v) for f, v in solved.items()}}, part)
        part.replace(ckpt_path)
        logf.flush()
        plot_curve(log_path, out / "training_curve.png")
        meta = {"step": state["step"], "minutes": round(state["elapsed"] / 60, 1),
                "stage_len": STAGES[state["stage"]], "args": {k: v for k, v in vars(args).items() if not callable(v)},
                "solved": {f: (sum(v) / len(v) if v else 0.0) for f, v in solved.items()}}
        export(model, out, meta)

    while state["step"] < args.max_steps and time.time() - t0 < args.minutes * 60:
        step = state["step"]
        # Warmup, constant, then a linear decay over the last --decay-frac of the time budget.
        left = 1.0 - (time.time() - t0) / (args.minutes * 60)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * max(0.1, min(1.0, left / args.decay_frac))
        for g in opt.param_groups:
            g["lr"] = lr
        hi = STAGES[state["stage"]]
        # Mostly the current stage; a quarter of batches revisit shorter lengths so they stay solved.
        if rng.random() < 0.25:
            length = rng.randint(64, hi)
        else:
            length = rng.randint(max(64, hi // 2), hi)
        # Half the batch is copy sequences until the induction heads work (copies
        # solved), then a fifth keeps them sharp.
        copies = 0 if not args.copy_aux else (1 if copy_rate and sum(copy_rate) / len(copy_rate) > 0.8 else 4)
        batch_families = families + [COPY] * copies
        bs = max(len(batch_families), args.tokens_per_batch // length)
        x, y, sol, fams = make_batch(batch_families, length, bs, rng)
        x, y = x.to(dev), y.to(dev)
        h = forward(model, x)
        rows = y != -100
        logits = model.compute_logits(h[rows])          # only where there is a loss
        loss = F.cross_entropy(logits, y[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            wrong = torch.zeros_like(y, dtype=torch.bool)
            wrong[rows] = logits.argmax(-1) != y[rows]
            ok = (~wrong).all(dim=1).tolist()
        for f, o in zip(fams, ok):
            (solved[f] if f in solved else copy_rate).append(bool(o))
        rate = {f: (sum(v) / len(v) if v else 0.0) for f, v in solved.items()}
        # Advance when every family is solved, or (so that one slow family does not
        # hold the others at short lengths) when the mean is and the stage is old.
        stage_steps = step - state.setdefault("stage_start", step)
        if (state["stage"] < len(STAGES) - 1 and all(len(v) == v.maxlen for v in solved.values())
                and length >= hi // 2
                and (min(rate.values()) >= args.advance_at
                     or (sum(rate.values()) / len(rate) >= args.advance_at - 0.05
                         and stage_steps >= args.patience))):
            state["stage"] += 1
            state["stage_start"] = step
            for v in solved.values():
                v.clear()
            tqdm.write(f"step {step}: curriculum -> max length {STAGES[state['stage']]}")
        state["step"] += 1
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        if step % 10 == 0:
            writer.writerow([step, round(time.time() - t0, 1), round(loss_ema, 5), lr, hi]
                            + [round(rate[f], 3) for f in families])
            bar.set_postfix(loss=f"{loss_ema:.3f}", L=hi, copy=f"{sum(copy_rate) / max(1, len(copy_rate)):.2f}", **{f[:4]: f"{rate[f]:.2f}" for f in families})
        bar.update(1)
        if time.time() - last_ck > args.checkpoint_every:
            save(); last_ck = time.time()
    save()
    bar.close()
    logf.close()
    if args.export:
        from services.compute.model.loader import save_model
        save_model(model, args.export, out / "tokenizer.json")
        print(f"exported to {args.export}")
    print(f"done: step {state['step']}, {state['elapsed'] / 60:.1f} min; model in {out / 'model'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvpop train-model", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
