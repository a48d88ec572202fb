"""tokrag_integrations.config: every environment variable is read there, at call time."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tokrag_integrations import config
from tokrag_integrations.config import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src" / "tokrag_integrations"
NAMES = sorted(set(re.findall(r'"(TOKRAG_[A-Z_]+)"', (SRC / "config.py").read_text(encoding="utf-8"))))


def test_every_variable_is_in_the_readme_table():
    """Each variable has a row in the README's table, the speed variables in docs/speed.md's
    table of Speed fields (field | variable | ...) instead."""
    readme = (SRC.parents[1] / "README.md").read_text(encoding="utf-8")
    speed = (SRC.parents[1] / "docs" / "speed.md").read_text(encoding="utf-8")
    table = set(re.findall(r"^\| `(TOKRAG_[A-Z_]+)` \|", readme, flags=re.M))
    speed_table = set(re.findall(r"^\| `\w+` \| `(TOKRAG_[A-Z_]+)` \|", speed, flags=re.M))
    assert len(speed_table) == 6 and not table & speed_table
    assert table | speed_table == set(NAMES)
    assert len(NAMES) == 15


def test_no_other_module_reads_the_environment():
    """Only config.py reads os.environ / os.getenv, in the runtime package and in the research
    harness (passing the whole environment on to a subprocess is not a read; RAY_ADDRESS is
    Ray's own variable)."""
    readers = []
    for path in [*SRC.rglob("*.py"), *(SRC.parent / "tokrag_eval").rglob("*.py")]:
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = ast.unparse(node.func)
                if target in ("os.environ.get", "os.getenv", "environ.get"):
                    arg = ast.unparse(node.args[0]) if node.args else ""
                    if arg != "'RAY_ADDRESS'":
                        readers.append(f"{path.relative_to(SRC.parent)}: {target}({arg})")
    assert readers == []


def test_defaults_when_unset_or_empty(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    assert config.api_key() is None and config.pg_dsn() is None
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert config.cache_dir() == Path("~/.cache/tokrag").expanduser() and config.data_dir() is None
    assert config.cpu_kernels() == "auto" and config.packed_head() == "auto"
    assert config.fuse_contexts() and config.packed_prefill() and config.kernel_plan_cache()
    assert config.split_prefill()
    assert not config.verbose()
    assert config.pg_connect_timeout() == 5 and config.pg_pool_size() == 10
    assert config.pg_pool_timeout() == 30.0 and config.stream_idle_timeout() == 30.0
    monkeypatch.setenv("TOKRAG_PG_POOL_SIZE", "  ")
    assert config.pg_pool_size() == 10


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.setenv("TOKRAG_PACKED_HEAD", " ON ")
    assert config.packed_head() == "on"
    monkeypatch.setenv("TOKRAG_PACKED_HEAD", "off")
    assert config.packed_head() == "off"
    monkeypatch.setenv("TOKRAG_PG_CONNECT_TIMEOUT", "2.5")
    assert config.pg_connect_timeout() == 3  # whole seconds, rounded up
    monkeypatch.setenv("TOKRAG_VERBOSE", "Yes")
    assert config.verbose()
    monkeypatch.setenv("TOKRAG_DATA_DIR", "~/tokrag-data")
    assert config.data_dir() == Path("~/tokrag-data").expanduser()
    monkeypatch.setenv("TOKRAG_STREAM_IDLE_TIMEOUT", "inf")  # never abandoned
    assert config.stream_idle_timeout() == float("inf")


@pytest.mark.parametrize(
    ("name", "value", "read"),
    [
        ("TOKRAG_CPU_KERNELS", "sometimes", config.cpu_kernels),
        ("TOKRAG_PACKED_HEAD", "1", config.packed_head),
        ("TOKRAG_FUSE_CONTEXTS", "nope", config.fuse_contexts),
        ("TOKRAG_PG_CONNECT_TIMEOUT", "inf", config.pg_connect_timeout),
        ("TOKRAG_PG_POOL_SIZE", "2.5", config.pg_pool_size),
        ("TOKRAG_PG_POOL_TIMEOUT", "nan", config.pg_pool_timeout),
        ("TOKRAG_STREAM_IDLE_TIMEOUT", "-1", config.stream_idle_timeout),
    ],
)
def test_bad_values_name_the_variable(monkeypatch, name, value, read):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(f"{name}={value!r}")):
        read()
    assert issubclass(ConfigError, ValueError)
