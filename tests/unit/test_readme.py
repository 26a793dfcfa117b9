"""Every ```python block of README.md runs as written, on CPU, and the README's TPKV_* table lists
exactly tpkv.settings.VARIABLES.

The only substitutions (what the README tells a user to change): `path = "path/to/a/llama"` names a
tiny seeded Llama saved here with save_pretrained (with a tokenizer and a chat template), and
`/mnt/nvme/tpkv` a temporary directory. A block whose first line names
`torchrun --nproc-per-node N file.py` runs under torchrun with N CPU (gloo) processes; every other
block runs as a script. Each runs in a fresh process (Ray and process groups start and end there).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpkv.settings import VARIABLES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MODEL_PATH = 'path = "path/to/a/llama"'
L3_ROOT = "/mnt/nvme/tpkv"
TORCHRUN = re.compile(r"torchrun --nproc-per-node (\d+) (\S+\.py)")
# transformers' deprecation warnings that the README's calls must not trigger
DEPRECATED = ("`past_key_values` is deprecated", "Passing `tp_plan` directly")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


BLOCKS = python_blocks(README.read_text())


def block_id(code: str) -> str:
    first = code.splitlines()[0]
    return re.sub(r"\W+", "-", first.lstrip("# "))[:40].strip("-")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("transformers")
    from tests.hf_cases import save_tiny_chat_model

    return save_tiny_chat_model(str(tmp_path_factory.mktemp("readme") / "tiny-llama"))


def substitute(code: str, model_dir: str, l3_root: Path) -> str:
    """The README's placeholders -> what exists here (nothing else is changed)."""
    return code.replace(MODEL_PATH, f"path = {model_dir!r}").replace(L3_ROOT, str(l3_root))


def run_block(code: str, tmp_path: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TPKV_") and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")}
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", CUDA_VISIBLE_DEVICES="",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               TPKV_DASHBOARD_PORT="0")  # any free port: 8470 may be another test's
    m = TORCHRUN.search(code.splitlines()[0])
    script = tmp_path / (m.group(2) if m else "snippet.py")
    script.write_text(code)
    if m:
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", "--nproc-per-node", m.group(1), script.name]
    else:
        cmd = [sys.executable, script.name]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def test_readme_has_the_blocks_this_test_knows():
    """A block added or dropped is seen here; the placeholders are where the README says."""
    assert len(BLOCKS) == 4, [block_id(b) for b in BLOCKS]
    assert sum(MODEL_PATH in b for b in BLOCKS) == 2  # the two transformers examples
    assert sum(L3_ROOT in b for b in BLOCKS) == 4
    assert sum(bool(TORCHRUN.search(b.splitlines()[0])) for b in BLOCKS) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("code", BLOCKS, ids=[block_id(b) for b in BLOCKS])
def test_readme_block_runs(code, tiny_checkpoint, tmp_path):
    l3 = tmp_path / "l3"
    l3.mkdir()
    out = run_block(substitute(code, tiny_checkpoint, l3), tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    for warning in DEPRECATED:
        assert warning not in log, log[-6000:]
    assert any(l3.iterdir()), "the L3 root was not used"  # each rank's owner lock at least
    if "tpkv.init(config)" in code:  # the Ray controller: rank 0 says where its dashboard is
        assert "tpkv: dashboard at http://" in out.stderr, log[-6000:]


def test_example_app_moves_blocks_through_every_tier(tmp_path, capsys, monkeypatch):
    """examples/app.py at TP 1, in-process controller: every direction moves, and it says so."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPKV_SSD_DIR", str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT))
    from examples.app import main

    moved = main("local")
    text = capsys.readouterr().out
    assert all(moved.get(d, 0) > 0 for d in ("L1->L2", "L2->L3", "L3->L2", "L2->L1")), moved
    assert "no dashboard" in text
    assert re.search(r"turn 3 chat-0: L3->L2 \d+, L2->L1 \d+", text), text
    assert re.search(r"where the blocks are now: L1 \d+, L2 \d+, L3 [1-9]", text), text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_app_under_torchrun_prints_the_dashboard(tmp_path):
    """examples/app.py at TP 2 (gloo) with the Ray controller: rank 0 prints the dashboard's
    URL once, and the turns' moves."""
    code = "# torchrun --nproc-per-node 2 app.py\n" + (ROOT / "examples" / "app.py").read_text()
    out = run_block(code.replace('tempfile.gettempdir()', repr(str(tmp_path))), tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    assert out.stderr.count("tpkv: dashboard at http://") == 1, log[-6000:]
    assert "TP 2" in out.stdout and "L3->L2" in out.stdout, log[-6000:]


def readme_variables(text: str) -> list[str]:
    """The first column of the table under the `| variable |` header."""
    lines = text[text.index("| variable |"):].splitlines()[2:]
    rows = lines[:next(i for i, line in enumerate(lines) if not line.startswith("|"))]
    return [re.findall(r"`(\w+)`", row.split("|")[1])[0] for row in rows]


def test_readme_lists_exactly_the_tpkv_variables():
    names = readme_variables(README.read_text())
    assert sorted(names) == sorted(VARIABLES), (names, sorted(VARIABLES))
    assert len(names) == len(set(names))
