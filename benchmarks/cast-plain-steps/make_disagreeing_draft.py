"""Write a draft that never agrees with the bundled target: the bundled draft with the rows of
its output layer permuted (same architecture, cost and confidence profile; wrong tokens).

    python benchmarks/cast-plain-steps/make_disagreeing_draft.py /tmp/shuffled-draft
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specdec.models.loading import bundled_draft


def main(out: Path) -> None:
    src = Path(bundled_draft())
    shutil.rmtree(out, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head = model.get_output_embeddings().weight  # [V, d]
        head.copy_(head[torch.randperm(head.shape[0], generator=generator)].clone())
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/shuffled-draft"))
