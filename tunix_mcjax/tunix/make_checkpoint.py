"""Writes a tiny random-init Qwen3 as a Hugging Face checkpoint with the Qwen3 tokenizer, for
the CPU Tunix recipe (`recipes/tunix/cpu/run_qwen3.sh`) and its test.

`python -m tunix_mcjax.tunix.make_checkpoint OUT_DIR` writes OUT_DIR/config.json (model_type
qwen3), OUT_DIR/model.safetensors (Hugging Face names, what Tunix's Qwen3 loader reads) and the
Qwen3 tokenizer MaxText's wheel ships, so OUT_DIR is both `model_config.model_download_path` and
`tokenizer_config.tokenizer_path`. Does nothing when OUT_DIR already holds a checkpoint.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

# 2 layers, 64 wide: the demo's tiny Qwen3, over Qwen3's real vocabulary.
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True}


def hf_config(seed: int = 0) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "torch_dtype": "float32", "init_seed": seed, **TINY}


def main(out: Path, seed: int = 0) -> None:
    from tunix_mcjax.tunix.model import has_checkpoint

    if has_checkpoint(str(out)):
        print(f"{out} holds a checkpoint: kept")
        return
    from tunix_mcjax import models
    from tunix_mcjax.config import load_config
    from tunix_mcjax.tokenizer import resolve_tokenizer_path

    cfg = load_config(None, {
        "base_num_decoder_layers": TINY["num_hidden_layers"], "base_emb_dim": TINY["hidden_size"],
        "base_mlp_dim": TINY["intermediate_size"],
        "base_num_query_heads": TINY["num_attention_heads"],
        "base_num_kv_heads": TINY["num_key_value_heads"], "head_dim": TINY["head_dim"],
        "vocab_size": TINY["vocab_size"], "rope_max_timescale": int(TINY["rope_theta"]),
        "init_weights_seed": seed})
    mc = models.model_config(cfg, TINY["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Path(resolve_tokenizer_path("qwen3-tokenizer"))
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    models.save_safetensors(models.create_model(mc, seed), mc, out)
    (out / "config.json").write_text(json.dumps(hf_config(seed), indent=2) + "\n")
    print(f"wrote a tiny Qwen3 checkpoint and the Qwen3 tokenizer to {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
