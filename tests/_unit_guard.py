"""What keeps ``tests/unit`` honest: while a unit test runs (its fixtures included), loading a
real model, starting the embedded Postgres, serving HTTP on a port or running the ``tokrag``
command in a subprocess fails the test, naming what it did and where such a test belongs.

Used by ``tests/unit/conftest.py``; a hand-built ``torch.nn.Module`` given to ``load_model``
is not a real model and stays allowed (nothing is read from disk or the hub)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

MOVE = "tests/integration"


class UnitGuardError(RuntimeError):
    """A unit test did something only an integration test may do."""


def _refuse(what: str, seen: list[str]) -> None:
    seen.append(what)
    raise UnitGuardError(f"a unit test {what}: move it to {MOVE} (or use a hand-built model)")


def _patch(stack: contextlib.ExitStack, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = owner.__dict__[name]
    setattr(owner, name, make(original))
    stack.callback(setattr, owner, name, original)


def _mentions_tokrag_command(args: Any) -> bool:
    argv = [args] if isinstance(args, (str, bytes)) else list(args or [])
    text = " ".join(str(a) for a in argv)
    first = str(argv[0]) if argv else ""
    return first.rsplit("/", 1)[-1] == "tokrag" or any(
        needle in text
        for needle in (
            "tokrag_integrations.cli",
            "-m tokrag_integrations",
            "load_model(",
            "start_embedded(",
            "pgserver",
        )
    )


@contextlib.contextmanager
def guarded(seen: list[str]) -> Iterator[None]:
    """Refuse real model loads, the embedded Postgres, HTTP servers and ``tokrag`` subprocesses
    inside the block; each refusal is appended to ``seen`` (so that a test which catches the
    exception still fails)."""
    with contextlib.ExitStack() as stack:
        from transformers import modeling_utils

        def model_load(original: Any) -> Any:
            def refuse(cls: Any, name: Any = None, *args: Any, **kwargs: Any) -> Any:
                _refuse(f"loaded a real model ({cls.__name__}.from_pretrained({name!r}))", seen)

            return classmethod(refuse)

        # transformers builds each Auto class (AutoModelForCausalLM ...) with its own copy of
        # _BaseAutoModelClass.from_pretrained when modeling_auto is first imported: import it
        # before patching, or a copy of the refusal outlives the block (it did, and then every
        # later integration test was refused). Their copies end in PreTrainedModel's, refused.
        import transformers.models.auto.modeling_auto  # noqa: F401

        _patch(stack, modeling_utils.PreTrainedModel, "from_pretrained", model_load)
        from transformers.models.auto import auto_factory

        _patch(stack, auto_factory._BaseAutoModelClass, "from_pretrained", model_load)

        with contextlib.suppress(ImportError):
            import sentence_transformers

            def embedder(original: Any) -> Any:
                def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
                    _refuse(f"loaded an embedding model ({args[:1]})", seen)

                return refuse

            _patch(stack, sentence_transformers.SentenceTransformer, "__init__", embedder)

        from tokrag_integrations.postgres import embedded as pg  # where the server class is chosen

        def postgres(original: Any) -> Any:
            def refuse(*args: Any, **kwargs: Any) -> Any:
                _refuse("started the embedded Postgres", seen)

            return refuse

        stack.enter_context(_module_attr(pg, "_server_class", postgres))

        with contextlib.suppress(ImportError):
            import uvicorn

            def serve(original: Any) -> Any:
                def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
                    _refuse("started an HTTP server (uvicorn)", seen)

                return refuse

            _patch(stack, uvicorn.Server, "run", serve)

        def popen(original: Any) -> Any:
            def check(self: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
                if _mentions_tokrag_command(args):
                    _refuse(f"ran the tokrag command, a model or Postgres in a subprocess ({args!r:.120})", seen)
                return original(self, args, *rest, **kwargs)

            return check

        _patch(stack, subprocess.Popen, "__init__", popen)
        yield


@contextlib.contextmanager
def _module_attr(module: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, make(original))
    try:
        yield
    finally:
        setattr(module, name, original)
