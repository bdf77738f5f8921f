"""`specdec --help` imports nothing heavy, and the core install (no extras) runs the Python
API and `specdec generate`, while commands that need an extra name it.

"Not installed" is simulated for real: a child Python runs without its site-packages (-S)
on a folder of links to every installed package except the extras' (fastapi, uvicorn,
pydantic, starlette, matplotlib, psutil, pillow, scipy).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

from specdec.methods import POLICY_CLASSES
from specdec.names import METHOD_NAMES

REPO = Path(__file__).resolve().parent.parent
EXTRAS_ONLY = ("fastapi", "uvicorn", "pydantic", "starlette", "matplotlib", "mpl_toolkits", "psutil", "pil", "pillow", "scipy")
"""site-packages entries (lowercased prefixes) hidden from the core-install child"""


def run_python(code: str, *, env_path: str | None = None, isolated: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    args = [sys.executable, *(["-S"] if isolated else []), "-c", textwrap.dedent(code)]
    env = {"PYTHONPATH": f"{env_path}:{REPO}" if env_path else str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def test_method_names_match_the_policies():
    assert tuple(POLICY_CLASSES) == METHOD_NAMES


def test_cli_parser_imports_no_torch():
    proc = run_python(
        """
        import sys
        import specdec.cli
        specdec.cli.build_parser()
        heavy = sorted(m for m in ("torch", "transformers", "numpy", "fastapi", "matplotlib", "PIL", "rich", "specdec.bench.runner") if m in sys.modules)
        print("heavy:", heavy)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "heavy: []" in proc.stdout


def test_help_is_quick():
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO, env={"PYTHONPATH": str(REPO)})
    elapsed = time.perf_counter() - started
    assert proc.returncode == 0 and "generate" in proc.stdout
    assert elapsed < 3.0, f"specdec --help took {elapsed:.1f} s"  # ~0.1 s; loose for a loaded machine (was ~5 s)


def core_only_site(tmp_path: Path) -> Path:
    """A folder of links to the installed packages minus the extras' ones."""
    site = Path(sysconfig.get_paths()["purelib"])
    core = tmp_path / "site"
    core.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(EXTRAS_ONLY) and not entry.name.endswith(".pth"):
            (core / entry.name).symlink_to(entry)
    return core


def test_core_install_runs_api_and_generate_and_names_missing_extras(tmp_path, tiny_pair_dir):
    core = core_only_site(tmp_path)
    out = tmp_path / "bench"
    proc = run_python(
        f"""
        import importlib.util
        hidden = [m for m in ("fastapi", "uvicorn", "pydantic", "matplotlib", "psutil", "PIL", "scipy") if importlib.util.find_spec(m)]
        assert not hidden, hidden
        from specdec.api import SpeculativeDecoder
        decoder = SpeculativeDecoder.from_pretrained({str(tiny_pair_dir / "target")!r}, {str(tiny_pair_dir / "draft")!r}, method="chain", device="cpu")
        print("api:", len(decoder.generate("def add(a, b):", max_new_tokens=6).token_ids))
        from specdec.cli import main
        pair = ["--target", {str(tiny_pair_dir / "target")!r}, "--draft", {str(tiny_pair_dir / "draft")!r}, "--device", "cpu"]
        print("generate:", main(["generate", *pair, "--prompt", "import os", "--max-new-tokens", "4", "--json"]))
        print("serve:", main(["serve", *pair]))
        print("bench:", main(["bench", *pair, "--out", {str(out)!r}]))
        print("image:", main(["generate", "--image", "x.png", "--prompt", "<image>"]))
        """,
        env_path=str(core),
        isolated=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "api: 6" in proc.stdout and "generate: 0" in proc.stdout
    assert "serve: 2" in proc.stdout and "specdec serve needs fastapi, uvicorn, pydantic" in proc.stderr and "pip install 'specdec[serve]'" in proc.stderr
    assert "bench: 2" in proc.stdout and "pip install 'specdec[bench]'" in proc.stderr
    assert "image: 2" in proc.stdout and "--image needs pillow" in proc.stderr and "pip install 'specdec[vision]'" in proc.stderr
    assert "Traceback" not in proc.stderr
