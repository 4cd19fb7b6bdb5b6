"""TLS and a shared bearer token for the internal gRPC APIs.

Configuration (environment; all optional, all off by default):

| variable | server side | client side |
| --- | --- | --- |
| `KVPOP_TLS_CERT`, `KVPOP_TLS_KEY` | PEM files: serve TLS with this certificate | presented as the client certificate (mTLS) |
| `KVPOP_TLS_CA` | PEM file: require client certificates signed by it (mTLS) | trust root for the server's certificate; setting it turns TLS on |
| `KVPOP_TLS_SERVER_NAME` | — | name expected in the server's certificate when it differs from the address |
| `KVPOP_INTERNAL_TOKEN` | reject calls without `authorization: Bearer <token>` (UNAUTHENTICATED) | send it on every call |
| `KVPOP_INTERNAL_TOKEN_FILE` | the token read from this file (whitespace stripped) instead: what `kvpop up` sets, so the secret is in no process's environment | the same |

One internal CA signing a certificate per service, with all four variables set
in every service, gives mutual TLS plus the token. The token alone (no TLS)
keeps strangers on a private network out but travels in clear text.
`grpc.health.v1.Health` is exempt from the token, so health probes need no
secret; with TLS they still need the CA (the probe reads the same variables).
"""
from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import grpc
import grpc.aio

ENV_TOKEN = "KVPOP_INTERNAL_TOKEN"
ENV_TOKEN_FILE = "KVPOP_INTERNAL_TOKEN_FILE"
ENV_CERT = "KVPOP_TLS_CERT"
ENV_KEY = "KVPOP_TLS_KEY"
ENV_CA = "KVPOP_TLS_CA"
ENV_SERVER_NAME = "KVPOP_TLS_SERVER_NAME"

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


class SecurityConfigError(ValueError):
    """The TLS/token environment is inconsistent or names unreadable files."""


@dataclass(frozen=True)
class SecurityConfig:
    token: str | None = None
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "SecurityConfig":
        env = os.environ if env is None else env

        def pem(var: str) -> bytes | None:
            return read_pem(var, env.get(var) or "")

        cert, key = pem(ENV_CERT), pem(ENV_KEY)
        if (cert is None) != (key is None):
            raise SecurityConfigError(f"set both {ENV_CERT} and {ENV_KEY}, or neither")
        token = env.get(ENV_TOKEN) or None
        token_file = env.get(ENV_TOKEN_FILE) or None
        if token and token_file:
            raise SecurityConfigError(f"set {ENV_TOKEN} or {ENV_TOKEN_FILE}, not both")
        if token_file:
            token = read_token(token_file)
        return cls(token=token, cert=cert, key=key, ca=pem(ENV_CA),
                   server_name=env.get(ENV_SERVER_NAME) or None)

    @classmethod
    def server_files(cls, cert: tuple[str, str], key: tuple[str, str], ca: tuple[str, str]) -> "SecurityConfig":
        """TLS of a server from (variable, path) pairs, the variables named in errors:
        cert and key, or neither; a CA requires client certificates signed by it."""
        c, k, a = (read_pem(*pair) for pair in (cert, key, ca))
        if (c is None) != (k is None):
            raise SecurityConfigError(f"set both {cert[0]} and {key[0]}, or neither")
        if a is not None and c is None:
            raise SecurityConfigError(f"{ca[0]} (client certificates) needs {cert[0]} and {key[0]} (TLS)")
        return cls(cert=c, key=k, ca=a)

    @property
    def server_tls(self) -> bool:
        return self.cert is not None

    @property
    def client_tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def read_pem(var: str, path: str) -> bytes | None:
    """The PEM file `path` ('' = none); SecurityConfigError naming `var` when unreadable."""
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"{var}={path}: cannot read ({e.strerror})") from e


def read_token(path: str | Path) -> str:
    """The token in `path` (surrounding whitespace stripped); SecurityConfigError
    when the file is unreadable or empty. A file others may read is used with
    a warning (container secrets are often mounted 0444)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as e:
        raise SecurityConfigError(f"{ENV_TOKEN_FILE}={path}: cannot read ({e.strerror})") from e
    if mode & 0o077:
        logging.getLogger(__name__).warning("%s=%s is readable by group or others (mode %o): chmod 600 it",
                                            ENV_TOKEN_FILE, path, mode & 0o777)
    if not token:
        raise SecurityConfigError(f"{ENV_TOKEN_FILE}={path}: empty")
    return token


def write_token(path: str | Path, token: str) -> Path:
    """Write `token` to `path`, created with mode 0600 (never readable by others, not even briefly)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    tmp.replace(path)
    return path


# ---- server side ---------------------------------------------------------

class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls whose `authorization` metadata is not `Bearer <token>`."""

    def __init__(self, token: str, exempt_prefixes: Sequence[str] = EXEMPT_PREFIXES):
        self._expected = f"Bearer {token}".encode()
        self._exempt = tuple(exempt_prefixes)

    def _authorised(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method.startswith(self._exempt):
            return True
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self._authorised(handler_call_details):
            return handler
        return _unauthenticated(handler)


_DENIED = "missing or wrong bearer token (KVPOP_INTERNAL_TOKEN)"


def _unauthenticated(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, _DENIED)


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind that ends every call with `code` and `message`.
    No request deserializer: a refused caller's bytes are never parsed."""
    async def deny(_request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    async def deny_stream(_request, context: grpc.aio.ServicerContext):
        # An async generator, as other interceptors (OpenTelemetry's) iterate
        # the behaviour of a streaming-response method.
        await context.abort(code, message)
        yield  # pragma: no cover

    ser = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, None, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, None, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, None, ser)
    return grpc.stream_stream_rpc_method_handler(deny_stream, None, ser)


def server_interceptors(cfg: SecurityConfig) -> list[grpc.aio.ServerInterceptor]:
    return [TokenAuthInterceptor(cfg.token)] if cfg.token else []


def server_credentials(cfg: SecurityConfig) -> grpc.ServerCredentials | None:
    if not cfg.server_tls:
        return None
    return grpc.ssl_server_credentials([(cfg.key, cfg.cert)], root_certificates=cfg.ca,
                                       require_client_auth=cfg.ca is not None)


def add_port(server: grpc.aio.Server, address: str, cfg: SecurityConfig) -> int:
    """Bind `address` with TLS when configured; returns the bound port."""
    creds = server_credentials(cfg)
    if creds is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, creds)


# ---- client side ---------------------------------------------------------

class _TokenMetadata(grpc.AuthMetadataPlugin):
    def __init__(self, token: str):
        self._md = (("authorization", f"Bearer {token}"),)

    def __call__(self, context, callback):
        callback(self._md, None)


def channel_credentials(cfg: SecurityConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials (with the token as call credentials), or None for plaintext."""
    if not cfg.client_tls:
        return None
    creds = grpc.ssl_channel_credentials(root_certificates=cfg.ca, private_key=cfg.key,
                                         certificate_chain=cfg.cert)
    if cfg.token:
        creds = grpc.composite_channel_credentials(
            creds, grpc.metadata_call_credentials(_TokenMetadata(cfg.token), name="kvpop-token"))
    return creds


def _with_token(details: grpc.aio.ClientCallDetails, md: tuple) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(tuple(details.metadata or ()) + md))
    return details._replace(metadata=metadata)


class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, md):
        self.md = md

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.md), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, md):
        self.md = md

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.md), request)


class _TokenStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, md):
        self.md = md

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.md), request_iterator)


class _TokenStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, md):
        self.md = md

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.md), request_iterator)


def client_interceptors(cfg: SecurityConfig) -> list[grpc.aio.ClientInterceptor]:
    """Token interceptors for a plaintext channel (TLS channels carry the
    token as call credentials instead, which gRPC refuses on plaintext)."""
    if not cfg.token or cfg.client_tls:
        return []
    md = cfg.call_metadata()
    return [_TokenUnaryUnary(md), _TokenUnaryStream(md), _TokenStreamUnary(md),
            _TokenStreamStream(md)]


def _options(cfg: SecurityConfig, options: Sequence[tuple[str, object]]) -> list:
    # Channels to one address otherwise share gRPC's global subchannels: a new
    # channel could pick up a connection the server had just sent GOAWAY on and
    # fail its call with INTERNAL (seen once in CI; grpc/grpc#14088).
    opts = [("grpc.use_local_subchannel_pool", 1)] + list(options)
    if cfg.server_name and cfg.client_tls:
        opts.append(("grpc.ssl_target_name_override", cfg.server_name))
    return opts


def aio_channel(address: str, cfg: SecurityConfig | None = None,
                options: Sequence[tuple[str, object]] = (),
                interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    """An asyncio channel to an internal API, secured as `cfg` (default: env) says."""
    cfg = SecurityConfig.from_env() if cfg is None else cfg
    creds = channel_credentials(cfg)
    chain = list(interceptors) + client_interceptors(cfg)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=_options(cfg, options),
                                         interceptors=chain or None)
    return grpc.aio.secure_channel(address, creds, options=_options(cfg, options),
                                   interceptors=chain or None)


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, md):
        self.md = md

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def sync_channel(address: str, cfg: SecurityConfig | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A blocking channel (health probes, scripts, tests) carrying the token
    when `cfg` has one (health checks are exempt from it anyway)."""
    cfg = SecurityConfig.from_env() if cfg is None else cfg
    creds = channel_credentials(cfg)
    if creds is None:
        channel = grpc.insecure_channel(address, options=_options(cfg, options))
        return grpc.intercept_channel(channel, _SyncToken(cfg.call_metadata())) if cfg.token else channel
    return grpc.secure_channel(address, creds, options=_options(cfg, options))
