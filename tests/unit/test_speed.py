"""``speed=`` and the one policy-options style (issue 34): no model is loaded."""

from __future__ import annotations

import pytest

from tokrag_integrations.policies import get_policy
from tokrag_integrations.speed import PRESETS, Speed, speed_of


def test_presets_and_dicts_give_speeds():
    assert speed_of(None) == speed_of("auto") == Speed() == Speed(**PRESETS["auto"])
    ref = speed_of("reference")
    assert (ref.fuse, ref.share_lens) == (False, False)
    got = speed_of({"packed_prefill": "false", "cpu_kernels": " OFF "})
    assert got == Speed(packed_prefill=False, cpu_kernels="off") and got.fuse is True
    assert speed_of(got) is got
    assert Speed().options() == {"fuse": True}
    assert Speed(fuse=False).options() == {"fuse": False}


def test_the_cuda_preset_and_where_the_static_state_is_asked_for():
    """``"cuda"``: the static state on every device; ``"auto"``: on a CUDA device only;
    ``"reference"``: never."""
    cuda = speed_of("cuda")
    assert (cuda.static, cuda.fuse, cuda.graphs) == ("on", True, "auto")
    assert cuda.wants_static("cpu") and cuda.wants_static("cuda")
    assert speed_of("auto").wants_static("cuda") and not speed_of("auto").wants_static("cpu")
    assert not speed_of("reference").wants_static("cuda")
    assert speed_of({"static": "OFF"}).static == "off"
    assert not speed_of({"static": "off"}).wants_static("cuda")


def test_each_speed_variable_is_the_default_of_one_field(monkeypatch):
    """The ``TOKRAG_*`` speed variables are read in one place: the defaults of :class:`Speed`,
    when one is made (a preset or a dict keeps the variables for the fields it leaves)."""
    env = {
        "TOKRAG_FUSE_CONTEXTS": ("0", "fuse", False),
        "TOKRAG_PACKED_PREFILL": ("0", "packed_prefill", False),
        "TOKRAG_SPLIT_PREFILL": ("0", "split_prefill", False),
        "TOKRAG_CPU_KERNELS": ("off", "cpu_kernels", "off"),
        "TOKRAG_PACKED_HEAD": ("on", "packed_head", "on"),
        "TOKRAG_KERNEL_PLAN_CACHE": ("0", "kernel_plan_cache", False),
    }
    for name, (value, field, want) in env.items():
        monkeypatch.setenv(name, value)
        assert getattr(Speed(), field) == want, name
        assert getattr(speed_of("reference"), field) == (False if field == "fuse" else want), name
        assert getattr(speed_of({"fuse": True}), field) == (True if field == "fuse" else want), name
        monkeypatch.delenv(name)
        assert getattr(Speed(), field) != want, name
    monkeypatch.setenv("TOKRAG_PACKED_HEAD", "sometimes")
    with pytest.raises(ValueError, match="TOKRAG_PACKED_HEAD"):
        Speed()


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("fast", ValueError, "unknown speed preset 'fast'; presets: auto, reference, cuda"),
        ({"static": "yes"}, ValueError, "static must be 'auto', 'on' or 'off'"),
        ({"graphs": True}, ValueError, "graphs must be 'auto', 'on', 'off' or 'capture'"),
        ({"fsue": False}, ValueError, "unknown speed option 'fsue'"),
        ({"speculative": True}, ValueError, "unknown speed option 'speculative'"),
        ({"cpu_kernels": "sometimes"}, ValueError, "cpu_kernels must be 'auto', 'on' or 'off'"),
        ({"fuse": "yes"}, ValueError, "fuse must be True or False"),
        (3, TypeError, "speed must be a Speed, a preset name or a dict, got int"),
    ],
)
def test_bad_speeds_are_refused_with_a_sentence(value, error, match):
    with pytest.raises(error, match=match):
        speed_of(value)


def test_a_speed_field_given_as_a_string_is_refused_by_the_dataclass():
    with pytest.raises(ValueError, match="share_lens must be True or False, got 'False'"):
        Speed(share_lens="False")  # type: ignore[arg-type]


def test_speed_choices_are_not_policy_options():
    for name in ("rag", "tokrag"):
        with pytest.raises(ValueError, match="unknown option 'fuse'"):
            get_policy(name, fuse=False)  # speed=, never an option of a rule
