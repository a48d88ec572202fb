"""The model side of the server: one loaded model, its micro-batcher and optional Postgres
store. :class:`ChatService` answers a checked :class:`~.schemas.ChatRequest` through the
micro-batcher (concurrent requests decode as one batch; the ``n`` sampled choices of one
request are concurrent calls, so they share a decode too); no FastAPI here (:mod:`.app` maps
HTTP onto it, :mod:`.ray_app` builds one per replica).

A request with tools or tool turns is rendered here with the model's tokenizer
(:func:`tokrag_integrations.structured.render_tools`); its ``response_format``,
``tokrag.constraint`` or tool call is compiled to a token constraint before the decode starts
(:func:`~tokrag_integrations.structured.constraint_for`,
:func:`~tokrag_integrations.structured.tool_call_constraint`), so a schema the library cannot
compile is a 400 before a stream sends its first byte.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import config
from ..defaults import ANSWER_STOP, TOP_K
from .refusals import Limits, RequestError
from .schemas import ChatRequest, split_conversation

if TYPE_CHECKING:
    from ..policies.base import Policy

__all__ = ["ChatService", "ServeConfig", "API_KEY_ENV", "checked_api_key"]

#: Environment variable holding the bearer token when ``--api-key`` is not given.
API_KEY_ENV = config.API_KEY


@dataclass
class ServeConfig:
    """Everything ``tokrag serve`` is told (the flags of the same names)."""

    model: str = "default"
    """Model to load (as :func:`~tokrag_integrations.load_model` takes it)."""
    device: str | None = None
    dtype: str | None = None
    policy: str = "tokrag"
    """Policy of requests that name none (``tokrag.policy`` overrides it per request)."""
    policy_options: dict[str, Any] = field(default_factory=dict)
    """Policy options of requests that give none (checked by the policy registry)."""
    stop: tuple[str, ...] | None = ANSWER_STOP
    """Stop strings of requests that give none (None: none)."""
    max_new_tokens: int = 64
    """``max_tokens`` of requests that give none."""
    limits: Limits = field(default_factory=Limits)
    max_queue: int = 64
    """Requests admitted at once (decoding or waiting); one more gets 429."""
    api_key: str | None = None
    """Bearer token required on ``/v1/*`` and ``/openapi.json`` (None: no auth; an empty key is
    refused)."""
    metrics: str = "key"
    """``/metrics``: ``"key"``, behind ``api_key`` as ``/v1/*``; ``"open"``, never behind it;
    ``"off"``, no such route."""
    max_batch: int | None = None
    """Largest batch of the micro-batcher (None here and below: the micro-batcher's default)."""
    batch_wait_s: float | None = None
    """How long the first request of a batch waits for companions."""
    max_rows: int | None = None
    """Most context rows one continuous decode holds (two per Tok-RAG request)."""
    max_positions: int | None = None
    """Most key/value positions (rows x (longest prompt + max_tokens)) of one decode."""
    continuous: bool = True
    """Requests that arrive while a decode runs join it at the next step (False: they wait)."""
    max_prefill_tokens: int | None = None
    """Most prompt tokens prefilled at one step boundary of a running decode."""
    store: str | None = None
    """``"postgres"``: retrieve from an ingested table when a request has no documents."""
    dsn: str | None = None
    table: str | None = None
    top_k: int = TOP_K
    embed_model: str | None = None
    data_dir: str | None = None
    sources_relative_to: str | None = None
    """A folder: the store's ``source`` (and ``file_path``) of each answer's sources are
    given relative to it, and those outside it as their file name alone, so clients do not
    see the server's folders (None: the absolute paths ingest stored)."""

    def resolved_api_key(self) -> str | None:
        """``api_key``, else ``$TOKRAG_API_KEY``, else None (no auth), checked by
        :func:`checked_api_key` (ValueError for a key no client could send)."""
        if self.api_key is not None:
            return checked_api_key(self.api_key, "--api-key")
        return checked_api_key(config.api_key(), f"${API_KEY_ENV}")


def checked_api_key(key: str | None, where: str) -> str | None:
    """``key`` when a client can send it as ``Authorization: Bearer <key>``.

    Raises:
        ValueError: (naming ``where``) ``key`` is empty (not read as "no auth": a key was
            asked for), has surrounding whitespace (clients strip it) or a character outside
            printable ASCII (clients cannot send it).
    """
    if key is None:
        return None
    if not key:
        raise ValueError(
            f"{where} is empty: give a key, or leave it unset to serve without authentication"
        )
    if key != key.strip():
        raise ValueError(
            f"{where} starts or ends with whitespace, which clients strip from the header, so "
            "every request would be refused; remove it"
        )
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValueError(
            f"{where} holds {ascii(key[bad])} at position {bad}: a key is printable ASCII "
            "(it travels in an HTTP header)"
        )
    return key


class ChatService:
    """Answers chat requests on one loaded model (thread-safe; all decoding off the loop)."""

    def __init__(self, lm: Any, config: ServeConfig | None = None, kb: Any = None) -> None:
        from ..engine.scheduler import MicroBatcher, batcher_for
        from ..policies import available_policies

        self.lm = lm
        self.config = config or ServeConfig()
        self.kb = kb
        root = self.config.sources_relative_to
        #: Where ``sources_relative_to`` lies, resolved as ingest resolves the files it stores.
        self.source_root = None if root is None else Path(root).expanduser().resolve()
        self.policies = available_policies()
        if self.config.policy not in self.policies:
            raise ValueError(
                f"unknown policy {self.config.policy!r}; available: {', '.join(self.policies)}"
            )
        c = self.config
        kw: dict[str, Any] = {
            name: value
            for name, value in (
                ("max_batch", c.max_batch),
                ("wait_s", c.batch_wait_s),
                ("max_rows", c.max_rows),
                ("max_positions", c.max_positions),
                ("continuous", None if c.continuous else False),
                ("max_prefill_tokens", c.max_prefill_tokens),
            )
            if value is not None
        }
        # The model's shared batcher, or one of the server's own with its bounds.
        self.batcher = MicroBatcher(lm, **kw) if kw else batcher_for(lm)
        #: Requests admitted now (decoding, waiting for a batch or retrieving).
        self.active = 0
        #: Streams that ended before their answer did (the client left, or the decode failed).
        self.streams_cut = 0

    @classmethod
    def load(cls, config: ServeConfig) -> ChatService:
        """Load the model (and open the store) that ``config`` names."""
        from ..models import load_model

        if config.store not in (None, "postgres"):
            raise ValueError(f"unknown store {config.store!r}; the server knows 'postgres'")
        kb = None
        if config.store == "postgres":
            from ..postgres import DEFAULT_TABLE, PostgresKnowledgeBase

            kb = PostgresKnowledgeBase(
                config.dsn, config.table or DEFAULT_TABLE, embed_model=config.embed_model,
                data_dir=config.data_dir,
            )
        lm = load_model(config.model, device=config.device, dtype=config.dtype)
        return cls(lm, config, kb)

    @property
    def model_id(self) -> str:
        return str(self.lm.name)

    # ------------------------------------------------------------------ requests
    def render(self, req: ChatRequest) -> None:
        """Render a conversation with tools or tool turns by the model's chat template (or the
        structured package's fallback block) and split it into ``req``'s query, history and
        system prompt; a request without them was split when it was parsed.

        Raises:
            RequestError: the structured extra is missing, or the rendered conversation does
                not end with a turn to answer.
        """
        if req.conversation is None:
            return
        render_tools = _structured("render_tools", "tools" if req.tools else "messages")
        try:
            turns = render_tools(self.lm.tokenizer, req.conversation, req.tools or [])
        except (TypeError, ValueError) as exc:
            raise RequestError(str(exc), "tools" if req.tools else "messages") from None
        split_conversation(req, turns)

    def settings(self, req: ChatRequest) -> dict[str, Any]:
        """The keyword arguments of :func:`~tokrag_integrations.generate` for ``req``
        (RequestError: the policy refuses the options)."""
        return self._settings(req)[0]

    def _settings(self, req: ChatRequest) -> tuple[dict[str, Any], Policy]:
        from ..policies import get_policy

        policy = req.policy or self.config.policy
        # The server's default options belong to its default policy; the request's win.
        base = self.config.policy_options if policy == self.config.policy else {}
        options = {**base, **req.options}
        try:
            checked = get_policy(policy, **options)  # checked here: a bad option is a 400 at once
        except (TypeError, ValueError) as exc:
            raise RequestError(str(exc), "tokrag.policy_options") from None
        stop = req.stop if req.stop is not None else list(self.config.stop or ())
        if req.calls_tools and not req.parallel_tool_calls:
            from ..structured.tool_specs import CALL_CLOSE

            stop = [*stop, CALL_CLOSE]  # one call: the decode ends where the first one does
        kw: dict[str, Any] = {
            "policy": policy,
            "max_new_tokens": req.max_tokens or self.config.max_new_tokens,
            "stop": stop,
            "messages": req.history or None,
            "policy_options": options,
            **req.sampling,
        }
        if req.logprobs and req.top_logprobs:
            kw["top_logprobs"] = req.top_logprobs
        if req.system_prompt is not None:
            kw["system_prompt"] = req.system_prompt
        for key in ("rendered", "prompt_format", "max_context_tokens", "citations"):
            if getattr(req, key) is not None:
                kw[key] = getattr(req, key)
        return kw, checked

    async def checked_settings(self, req: ChatRequest) -> dict[str, Any]:
        """:meth:`settings`, with the policy also fitted to the loaded model (off the loop),
        so that an option the model refuses (``fixed_layer`` beyond its depth...) is a 400
        before a stream sends its first byte."""
        kw, policy = self._settings(req)
        try:
            await asyncio.to_thread(policy.prepare, self.lm)
        except (TypeError, ValueError) as exc:
            raise RequestError(str(exc), "tokrag.policy_options") from None
        return kw

    def draws(self, req: ChatRequest) -> int:
        """Decodes ``req`` needs: one per choice when sampled, one for all when greedy (every
        greedy choice is the same answer)."""
        return req.n if req.sampling.get("temperature") else 1

    async def per_draw(self, req: ChatRequest) -> list[dict[str, Any]]:
        """The decode keywords of each of ``req``'s :meth:`draws`: the settings, draw ``i``'s
        seed (``seed + i``) and its own compiled constraint (RequestError: the constraint
        does not compile)."""
        kw = await self.checked_settings(req)
        draws = self.draws(req)
        if req.n > 1 and draws == 1:
            req.warnings.append(f"n={req.n} with greedy decoding (temperature 0 or absent): the "
                                "choices are one answer, decoded once")
        constraint = await asyncio.to_thread(self._constraint, req)
        out = []
        for i in range(draws):
            each = dict(kw)
            if "seed" in kw:
                each["seed"] = kw["seed"] + i
            if constraint is not None:
                each["constraint"] = constraint if i == 0 else constraint.fork()
            out.append(each)
        return out

    def _constraint(self, req: ChatRequest) -> Any:
        """``req``'s token constraint, compiled for the loaded model (None: free text)."""
        if req.calls_tools:
            build = _structured("tool_call_constraint", "tools")
            try:
                return build(req.tools, req.tool_choice, self.lm)
            except ImportError as exc:
                raise RequestError(f"this server cannot honour 'tools': {exc}", "tools") from None
            except (TypeError, ValueError) as exc:
                raise RequestError(str(exc), "tools") from None
        if req.constraint is None:
            return None
        where = "response_format" if req.constraint["type"].startswith("json") else "tokrag.constraint"
        constraint_for = _structured("constraint_for", where)
        try:
            return constraint_for(req.constraint, self.lm)
        except ImportError as exc:
            raise RequestError(f"this server cannot honour '{where}': {exc}", where) from None
        except (TypeError, ValueError) as exc:
            raise RequestError(str(exc), where) from None

    async def passages(self, req: ChatRequest) -> tuple[list[Any] | None, list[str]]:
        """``(passages, warnings)``: the request's documents, else the store's top chunks for
        its question, else None (also when the request brings its template's context)."""
        if req.rendered is not None:
            return None, []
        if req.documents is not None:
            if req.filters is not None:
                return req.documents, ["tokrag.filters ignored: the request gave documents"]
            return req.documents, []
        if self.kb is None:
            if req.filters is not None or req.top_k is not None:
                raise RequestError(
                    "tokrag.filters and tokrag.top_k need a server started with --store "
                    "postgres; give 'documents' instead", "tokrag"
                )
            return None, []
        from ..prompts import Passage

        top_k = req.top_k or self.config.top_k
        try:
            chunks = await asyncio.to_thread(self.kb.retrieve, req.query, top_k, req.filters)
        except ValueError as exc:  # a bad filter, or a question no query can carry
            field = getattr(exc, "field", None)  # a SearchInputError's: "query", "filters.<key>"
            raise RequestError(str(exc), "messages" if field == "query" else "tokrag.filters") from None
        except Exception as exc:
            from ..postgres import PostgresConnectionError

            if isinstance(exc, PostgresConnectionError):
                # The reason names the database and its socket folder: the operator's log
                # gets it, the client a sentence without server paths.
                logging.getLogger("tokrag.serve").error("retrieval failed: %s", exc)
                raise RequestError(
                    "retrieval failed: the database could not be searched (the server's log "
                    "says why)", None, 503, "server_error",
                ) from None
            raise
        return [
            Passage(c.text, score=c.score,
                    metadata=self._shown({**c.passage_metadata, "chunk": c.chunk}))
            for c in chunks
        ], []

    def _shown(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """A chunk's metadata as clients see it: paths relative to ``sources_relative_to``."""
        if self.source_root is None:
            return metadata
        from ..postgres.store import PATH_KEYS, relative_source

        return {
            k: relative_source(v, self.source_root) if k in PATH_KEYS and isinstance(v, str) else v
            for k, v in metadata.items()
        }

    async def complete(self, req: ChatRequest, passages: list[Any] | None) -> list[Any]:
        """Decode ``req``'s draws through the micro-batcher, concurrently (so they share a
        decode): one result per draw. Cancelling the awaiting task drops them from their batch
        (or stops their decode at the next step)."""
        from ..engine.streams import run_cancellable

        batcher = self.batcher

        async def one(kw: dict[str, Any]) -> Any:
            return await run_cancellable(
                lambda cancel: batcher.generate(req.query, passages, _cancel=cancel, **kw)
            )

        draws = await self.per_draw(req)  # its RequestError names the field
        tasks = [asyncio.ensure_future(one(kw)) for kw in draws]
        try:
            return list(await asyncio.gather(*tasks))
        except (TypeError, ValueError) as exc:
            raise RequestError(str(exc), _field_of(exc)) from None
        finally:
            for t in tasks:  # one failed or the client left: the others stop too
                t.cancel()

    async def open_streams(self, req: ChatRequest, passages: list[Any] | None) -> list[Any]:
        """Started-on-first-read :class:`~tokrag_integrations.api.TokenStream` objects, one
        per draw of ``req`` (validation errors are raised here, before any byte of the
        response is sent)."""
        draws = await self.per_draw(req)  # its RequestError names the field
        streams: list[Any] = []
        try:
            for kw in draws:
                streams.append(
                    await asyncio.to_thread(self.batcher.stream, req.query, passages, **kw))
        except (TypeError, ValueError) as exc:
            for s in streams:
                s.close()
            raise RequestError(str(exc), _field_of(exc)) from None
        return streams


#: The request fields the engine's sampling keywords come from (its messages name them).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "top_logprobs")


def _field_of(exc: Exception) -> str | None:
    """The request field an engine ValueError names, when it names a sampling keyword."""
    text = str(exc)
    return next((f for f in _SAMPLING_FIELDS if text.startswith(f) or f"'{f}'" in text
                 or f"{f}=" in text), None)


def _structured(name: str, where: str) -> Any:
    """``tokrag_integrations.structured.<name>``, or a 400 naming ``where`` when the server
    lacks the structured extra."""
    try:
        from .. import structured
    except ImportError as exc:
        raise RequestError(f"this server cannot honour '{where}': {exc}", where) from None
    return getattr(structured, name)
