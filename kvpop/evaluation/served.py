"""`kvpop eval --via HOST:PORT`: the eval's prompts through a running gateway
(real gRPC, real compute, real cache-manager), so served quality is measured,
not assumed. Same instances, budgets, sink, recent window and greedy decoding
as the in-process harness; the budget is the same count of tokens. KL needs
teacher forcing, which the public API does not offer: it is reported as 0.

Outcomes also record who ranked each evicted block (usage), so a served
`learned` result says how much of it was the network's."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, as_completed

import grpc
from tqdm import tqdm

from kvpop.evaluation.harness import (Outcome, Setting, budget_tokens, count_decisions, policy_spec, recent_tokens,
                                      record_kv, set_protocol)
from kvpop.tasks.checker import is_correct


class ServedHarness:
    def __init__(self, address: str, sink: int = 4, recent: int = 8, margin: int = 16, concurrency: int = 16,
                 timeout: float = 600.0):
        from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc
        from services.compute.eviction.budget import min_budget_blocks

        self.pb = generate_pb2
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
        self.stub = generate_pb2_grpc.KVpopStub(self.channel)
        self.info = self.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
        self.bs = self.info.block_size
        import torch

        from services.compute.engine.kv_pool import KVPool
        self.rows = self.info.num_layers * self.info.num_kv_heads
        self.block_bytes = KVPool.page_bytes(self.bs, self.info.head_dim, getattr(torch, self.info.dtype or "float32"))
        self.sink, self.recent, self.margin = sink, recent, margin
        self.concurrency, self.timeout = concurrency, timeout
        self.min_budget = min_budget_blocks(-(-sink // self.bs), recent, self.bs) * self.bs
        self.decisions: dict[tuple[str, float], dict[str, int]] = {}
        self._lock = threading.Lock()

    def _request(self, o: Outcome):
        inst, s = o.instance, o.setting
        chat = getattr(inst, "messages", None)
        req = self.pb.GenerateRequest(prompt="" if chat else inst.prompt,
                                      messages=[self.pb.ChatMessage(**m) for m in chat or []],
                                      max_tokens=len(inst.solution_ids) + self.margin,
                                      temperature=0.0, policy=policy_spec(s.policy)[0], sink_tokens=self.sink,
                                      recent_tokens=self.recent)
        if s.policy != "dense":
            o.budget = budget_tokens(inst, s.compression, self.min_budget)
            req.budget_tokens = o.budget
            req.recent_tokens = recent_tokens(s.policy, o.budget, self.recent, self.sink, self.bs)
            set_protocol(req, s.policy)
        return req

    def _run_one(self, o: Outcome) -> None:
        text, ids, usage = [], 0, None
        try:
            for msg in self.stub.Generate(self._request(o), timeout=self.timeout):
                if msg.HasField("chunk"):
                    text.append(msg.chunk.text)
                    ids += len(msg.chunk.token_ids)
                else:
                    usage = msg.finished.usage
        except grpc.RpcError as e:
            # One refused request (a pool too small for it, a prompt past the model's
            # length) is that request's result; the rest of the eval still runs.
            o.error = f"{e.code().name}: {e.details()}"
            return
        o.text = "".join(text)
        o.generated = ids
        o.correct = is_correct(o.instance, o.text)
        record_kv(o, usage, self.rows, self.bs, self.block_bytes)
        with self._lock:
            count_decisions(self.decisions, o, usage)

    def run(self, settings: list[Setting], instances, desc: str = "eval via gateway", reference=None) -> list[Outcome]:
        outcomes = [Outcome(s, inst) for s in settings for inst in instances]
        if any(not o.instance.prompt for o in outcomes):
            raise ValueError("instances need their prompt text to be sent through the gateway")
        bar = tqdm(total=len(outcomes), desc=desc, dynamic_ncols=True, mininterval=2)
        with ThreadPoolExecutor(self.concurrency) as pool:
            for fut in as_completed([pool.submit(self._run_one, o) for o in outcomes]):
                fut.result()
                bar.update(1)
        bar.close()
        return outcomes     # no KL: the served path has no teacher-forced pass (the table shows "-")

    def close(self) -> None:
        self.channel.close()
