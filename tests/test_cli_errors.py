"""Bad input to the CLI: exit status 2 and one line naming the value and the fix, never a
traceback, and checked before any model is loaded or anything measured."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from conftest import needs_serve

from specdec import cli
from specdec.cli import main


def run_cli(capsys, *args: str) -> tuple[int, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the error must come first."""

    def refuse(*args, **kwargs):
        pytest.fail("a model was loaded before the bad value was reported")

    import specdec.api
    import specdec.models.loading

    real = specdec.models.loading.load_model
    monkeypatch.setattr(specdec.models.loading, "load_model", refuse)
    monkeypatch.setattr(specdec.api.SpeculativeDecoder, "from_pretrained", refuse)
    yield
    # a module that imported load_model by name while it was patched (e.g. specdec.bench.runner,
    # first imported by a test here) would keep `refuse` for every later test: put the real one back
    for module in [m for name, m in sys.modules.items() if name.startswith("specdec")]:
        if getattr(module, "load_model", None) is refuse:
            module.load_model = real


def pair_args(pair: Path) -> list[str]:
    return ["--target", str(pair / "target"), "--draft", str(pair / "draft"), "--device", "cpu"]


# ----- prompt files ------------------------------------------------------------------------
def test_prompt_file_not_utf8(capsys, tmp_path, tiny_pair_dir, no_loading):
    path = tmp_path / "latin1.txt"
    path.write_bytes("d\xe9f add(a, b):".encode("latin-1"))
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt-file", str(path))
    assert code == 2 and "is not UTF-8 text" in err and "iconv" in err and str(path) in err


def test_prompt_file_unreadable(capsys, monkeypatch, tmp_path, tiny_pair_dir, no_loading):
    path = tmp_path / "secret.txt"
    path.write_text("x")
    original = Path.read_text

    def read_text(self, *args, **kwargs):  # chmod 000 does not stop root, so refuse the read itself
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt-file", str(path))
    assert code == 2 and "cannot be read (Permission denied)" in err


def test_prompt_file_is_a_directory(capsys, tmp_path, tiny_pair_dir, no_loading):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt-file", str(tmp_path))
    assert code == 2 and "is a directory" in err and "does not exist" not in err


# ----- values ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [str(2**64), str(2**70), str(-(2**63) - 1)])
def test_seed_beyond_64_bits(capsys, tiny_pair_dir, seed):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt", "x", "--temperature", "1", "--seed", seed)
    assert code == 2 and f"--seed {seed} does not fit in 64 bits" in err


def test_largest_seed_works(capsys, tiny_pair_dir):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt", "x", "--temperature", "1", "--seed", str(2**64 - 1), "--max-new-tokens", "4")
    assert code == 0, err


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_temperature_not_finite(capsys, tiny_pair_dir, value):
    code, err = run_cli(capsys, "generate", *pair_args(tiny_pair_dir), "--prompt", "x", f"--temperature={value}")
    assert code == 2 and "must be a finite number >= 0" in err


# ----- bench / profile outputs and lists ----------------------------------------------------
def test_bench_out_is_an_existing_file(capsys, tmp_path, tiny_pair_dir, no_loading):
    out = tmp_path / "results.json"
    out.write_text("{}")
    code, err = run_cli(capsys, "bench", *pair_args(tiny_pair_dir), "--methods", "ar,chain", "--no-progress", "--out", str(out))
    assert code == 2 and "is an existing file" in err and out.read_text() == "{}"


def test_bench_empty_methods(capsys, tmp_path, tiny_pair_dir, no_loading):
    code, err = run_cli(capsys, "bench", *pair_args(tiny_pair_dir), "--methods", "", "--out", str(tmp_path / "b"))
    assert code == 2 and "--methods '' names no method" in err
    code, err = run_cli(capsys, "bench", *pair_args(tiny_pair_dir), "--methods", " , ", "--out", str(tmp_path / "b"))
    assert code == 2 and "names no method" in err


def test_profile_out_is_a_directory(capsys, monkeypatch, tmp_path, tiny_pair_dir, no_loading):
    code, err = run_cli(capsys, "profile", *pair_args(tiny_pair_dir), "--out", str(tmp_path))
    assert code == 2 and "is a directory" in err and "cost_profile.json" in err


def test_profile_context_beyond_the_models(capsys, monkeypatch, tmp_path, tiny_pair_dir):
    import specdec.cost.profile

    monkeypatch.setattr(specdec.cost.profile, "profile_models", lambda *a, **k: pytest.fail("measured before checking the context"))
    code, err = run_cli(capsys, "profile", *pair_args(tiny_pair_dir), "--context-step", "100000", "--out", str(tmp_path / "p.json"))
    assert code == 2 and "--context-step 100000" in err and "context of 256" in err
    assert "use --context-step 32 or less" in err  # (256 - 128) // 4
    assert not (tmp_path / "p.json").exists()


# ----- serve ------------------------------------------------------------------------------
@needs_serve
def test_serve_port_in_use_before_loading(capsys, tiny_pair_dir, no_loading):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, err = run_cli(capsys, "serve", *pair_args(tiny_pair_dir), "--port", str(port))
    assert code == 2 and f"--port {port} on 127.0.0.1 is not free" in err and "pick another --port" in err


def test_serve_free_port_passes_the_check():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cli.check_port_free("127.0.0.1", port)
    cli.check_port_free("127.0.0.1", 0)
