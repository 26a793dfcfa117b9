"""bench/vllm_copy.py at toy size on the CPU: every mode runs, checks its loads bit-exact, and
records its time against the ceiling of the same run; the JSON and PNG are written."""

from __future__ import annotations

import json
from pathlib import Path

from bench.vllm_copy import main


def test_every_mode_is_timed_against_the_ceiling_of_its_run(tmp_path: Path) -> None:
    out = tmp_path / "vllm_copy.json"
    main(["--layers", "2", "--page-kib", "4", "--blocks", "6", "--reps", "2", "--device", "cpu",
          "--out", str(out)])
    result = json.loads(out.read_text())
    assert list(result["modes"]) == ["save", "load", "load by layer", "background"]
    for mode in result["modes"].values():
        assert mode["ms"] > 0 and mode["ceiling_gb_s"] > 0
        assert abs(mode["ratio"] - mode["gb_s"] / mode["ceiling_gb_s"]) < 1e-9
    assert (result["blocks"], result["block_bytes"]) == (6, 2 * 4096)
    assert result["command"].endswith("--out " + str(out))
    assert (tmp_path / "vllm_copy.png").stat().st_size > 0
