"""Options: bad input fails with a message naming the option."""

from __future__ import annotations

import pytest

from kvobs.options import OptionError, Options, parse_options


def test_defaults_and_env_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOBS_DIR", "/tmp/kvobs-x")
    opts = parse_options({})
    assert opts.history_size == 1_000_000 and opts.dir == "/tmp/kvobs-x"
    monkeypatch.delenv("KVOBS_DIR")
    assert parse_options({}).dir is None


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        ({"histroy_size": 5}, "unknown kvobs option 'histroy_size'"),
        ({"history_size": "big"}, "'history_size' must be an integer"),
        ({"history_size": True}, "'history_size' must be an integer"),
        ({"history_size": 10}, r"'history_size' must be in \[1024, "),
        ({"max_verdicts": 0}, "'max_verdicts' must be in"),
        ({"dir": 3}, "'dir' must be a non-empty string"),
        ({"engine": ""}, "'engine' must be a non-empty string"),
        ({"engine": "node-a/dp0"}, "'engine' must be 1-64 letters"),  # a path: the journal written elsewhere
        ({"engine": "../dp0"}, "'engine' must be 1-64 letters"),
        ({"engine": ".hidden"}, "'engine' must be 1-64 letters"),
        ({"engine": "x" * 65}, "'engine' must be 1-64 letters"),
    ],
)
def test_bad_options_name_the_option(raw: dict[str, object], pattern: str) -> None:
    with pytest.raises(OptionError, match=pattern):
        parse_options(raw)


def test_not_a_mapping() -> None:
    with pytest.raises(OptionError, match="must be a mapping"):
        parse_options([("history_size", 1)])  # type: ignore[arg-type]


def test_options_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Options().history_size = 3  # type: ignore[misc]


def test_engine_labels_as_vllm_and_operators_write_them_are_accepted() -> None:
    for label in ("0", "dp3", "node-a.dp0", "pod:7", "llama_70b-2"):
        assert parse_options({"engine": label}).engine == label
