"""Router settings: typed, frozen, filled from flags and SPLITSERVE_ROUTER_* environment variables."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class RouterConfig(BaseSettings):
    """One router process. Worker lists, when given, replace the Redis registry (tests, fixed setups)."""

    model_config = SettingsConfigDict(
        env_prefix="SPLITSERVE_ROUTER_", frozen=True, extra="forbid", env_ignore_empty=True
    )

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="the OpenAI API's port")
    advertise_host: str | None = Field(
        None,
        description="the address the planner reaches this router's /metrics at, registered in Redis "
        "(planner --discover-routers); default: host, or with a wildcard host the address this machine's "
        "hostname resolves to; 'auto': that address always (containers: the pod or container IP)",
    )
    redis_url: str | None = Field(None, description="request records and the worker registry")
    redis_prefix: str = "splitserve:"
    # Several models: `--model A --model B` (the environment: comma-separated, or a JSON list), each named
    # by the served_model_name in the same place (router/served_model.py).
    model: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="GGUF file, HF folder or hub id of the served model, for its tokenizer and chat "
        "template; default SmolLM2",
    )
    served_model_name: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="the OpenAI model name of each --model, in the same order; default: the model id",
    )
    tool_call_parser: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="how the model writes tool calls (docs/openai_api.md): hermes, llama3_json, mistral, or "
        "auto (the default: detected from its chat template); one value for every model, or one per --model",
    )
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template, or the path of a file holding one, instead of the model's own "
        "(one model only)",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="context length (prompt + completion), of every model; default and upper bound: the "
        "model's",
    )
    local_prefill_threshold: int = Field(
        32, ge=0, description="prompts shorter than this (tokens) are prefilled on the decode service"
    )
    request_timeout_s: float = Field(600.0, gt=0, description="deadline for one request, end to end")
    prefix_cache_scope: Literal["tenant", "shared"] = Field(
        "tenant",
        description="tenant: each tenant's prompts are cached apart (no tenant can tell what another sent "
        "from cached_tokens, timing or routing); shared: one prefix cache for every tenant (more hits on "
        "a common system prompt; only where tenants trust each other)",
    )
    routing: Literal["prefix_aware", "least_loaded"] = Field(
        "prefix_aware",
        description="prefix_aware: weigh the prompt blocks each service already holds (KV events, needs "
        "Redis) against its load; least_loaded: load alone",
    )
    prefix_weight: float = Field(
        1.0, ge=0, description="prefix_aware: cost of one prompt block a service would compute or receive"
    )
    load_weight: float = Field(
        1.0, ge=0, description="prefix_aware: cost of one queued prompt block or one running sequence"
    )
    # Comma-separated in the environment ("http://a:8001,http://b:8001") as well as a JSON list.
    decode_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    prefill_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    slo_ttft_ms: float | None = Field(None, gt=0, description="TTFT objective; misses are counted")
    slo_tpot_ms: float | None = Field(None, gt=0, description="time-per-output-token objective")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request leaves it out")
    retry_after_s: int = Field(1, ge=0, description="Retry-After on 503 answers")
    connect_timeout_s: float = Field(2.0, gt=0, description="connecting to a prefill/decode service")
    transfer_failure_policy: Literal["retry", "recompute", "fail"] = Field(
        "retry",
        description="when prefill or its KV transfer fails: retry on another prefill service (new fence), "
        "else prefill on the decode service; recompute on the decode service at once; or fail the request",
    )
    max_migrations: int = Field(
        3, ge=0, description="times one request may move to another decode service when its own fails"
    )
    decode_stall_s: float = Field(
        15.0, gt=0, description="a generating decode stream silent this long counts as failed (migrated)"
    )
    max_decode_queue: int | None = Field(
        None, ge=1, description="503 + Retry-After once every decode service has this many requests waiting"
    )
    start_timeout_s: float | None = Field(
        None,
        gt=0,
        description="503 + Retry-After for a request that cannot start (first token) this soon: refused "
        "up front when every decode queue's oldest request has waited this long, given up (work freed) "
        "when its first token is later",
    )

    # --- who may call, and how much (docs/security.md) ---
    require_api_key: bool = Field(
        False, description="every call but /health needs an API key, even before the first key exists"
    )
    api_key: str | None = Field(
        None,
        description="one API key with every scope (20+ printable characters); required from every caller. "
        "Prefer the environment variable: a flag shows in the process list",
    )
    api_keys_file: str | None = Field(
        None, description="static API keys, one per line: `<secret> [name=..] [tenant=..] [rpm=..] ...`"
    )
    allow_unauthenticated: bool = Field(
        False, description="serve without API keys on an address other machines can reach"
    )
    ssl_certfile: str | None = Field(None, description="serve HTTPS: certificate chain (PEM)")
    ssl_keyfile: str | None = Field(None, description="serve HTTPS: the certificate's private key")
    internal_ca_file: str | None = Field(
        None, description="CA bundle to verify the services' HTTPS (default: the system's)"
    )
    internal_tls_check_hostname: bool = Field(
        True,
        description="match the services' certificates to their registered host names; off: the chain to "
        "internal_ca_file alone (a private CA whose certificates cannot name pod IPs)",
    )
    # --- limits on every input ---
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest request body (413 beyond)")
    max_stop_chars: int = Field(256, ge=1, description="longest stop sequence, in characters")
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request's headers must arrive this soon (slow-loris clients are cut)"
    )
    body_timeout_s: float = Field(30.0, gt=0, description="a request's body must arrive this soon")
    keep_alive_s: int = Field(5, ge=1, description="idle keep-alive connections are closed after this")
    max_connections: int | None = Field(
        1024, ge=1, description="open connections (and requests in flight) at once; beyond, new ones get 503"
    )
    parse_workers: int = Field(
        2,
        ge=0,
        description="worker processes that prepare large requests (JSON, chat template, tokenizer, guides) "
        "off the router's event loop; 0: all on the loop",
    )
    parse_queue: int = Field(
        8, ge=0, description="large requests waiting for a parse worker at most; beyond, 503 + Retry-After"
    )
    parse_inline_bytes: int = Field(
        16384,
        ge=0,
        description="bodies up to this size are prepared on the event loop (cheaper than in a worker)",
    )
    refusals_per_minute: int = Field(
        20,
        ge=1,
        description="a rate-limited key's requests refused after parsing (400) per minute; past them its "
        "requests get 429 before any parsing",
    )
    log_content: bool = Field(
        False,
        description="put prompts and completions in logs and spans (OpenTelemetry GenAI content capture)",
    )
    metrics_max_tenants: int = Field(
        20,
        ge=0,
        description="tenants that get a `tenant` label value of their own in the router's metrics (the "
        "first seen since start); the rest are counted as `_other`",
    )

    @field_validator(
        "decode_urls", "prefill_urls", "model", "served_model_name", "tool_call_parser", mode="before"
    )
    @classmethod
    def _split_urls(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            if v.startswith("["):
                import json

                return json.loads(v)
            return [u.strip() for u in v.split(",") if u.strip()]
        return v

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parsers(cls, v: list[str]) -> list[str]:
        from router.tool_formats import PARSER_NAMES

        unknown = [p for p in v if p not in PARSER_NAMES]
        if unknown:
            listed = ", ".join(map(repr, unknown))
            raise ValueError(f"unknown tool call parser {listed}: choose from {', '.join(PARSER_NAMES)}")
        return v

    @field_validator("advertise_host")
    @classmethod
    def _resolve_auto(cls, v: str | None) -> str | None:
        from common.config import resolve_advertise_host

        return resolve_advertise_host(v)

    def metrics_url(self) -> str | None:
        """Where other processes reach this router (its /metrics, for the planner): None when the port is
        chosen at bind time (0), or when the host is a wildcard and the hostname does not resolve."""
        from common.config import http_url, resolve_advertise_host

        if self.port == 0:
            return None
        host = self.advertise_host or self.host
        if host in ("0.0.0.0", "::", ""):
            try:
                host = resolve_advertise_host("auto") or host
            except ValueError:
                return None
        return http_url(host, self.port, bool(self.ssl_certfile))

    @field_validator("decode_urls", "prefill_urls")
    @classmethod
    def _strip_slash(cls, v: list[str]) -> list[str]:
        return [u.rstrip("/") for u in v]

    @model_validator(mode="after")
    def _one_model_only(self) -> RouterConfig:
        """What holds for one model only: a fixed worker list carries no model name, and a chat
        template replaces one model's own."""
        if len(self.model) > 1 and (self.decode_urls or self.prefill_urls):
            raise ValueError(
                "fixed worker lists (decode_urls, prefill_urls) serve one model: with several, the "
                "router finds each model's services in the Redis registry"
            )
        if len(self.model) > 1 and self.chat_template is not None:
            raise ValueError("chat_template replaces one model's template: leave it out with several models")
        if len(self.served_model_name) > max(1, len(self.model)):
            raise ValueError(
                f"{len(self.served_model_name)} served model names for {max(1, len(self.model))} models: "
                "give one per --model, in the same order"
            )
        if len(self.tool_call_parser) not in (0, 1, max(1, len(self.model))):
            raise ValueError(
                f"{len(self.tool_call_parser)} tool call parsers for {max(1, len(self.model))} models: give "
                "one for every model, or one per --model in the same order"
            )
        return self
