"""Write a GGUF model as a Hugging Face directory (bf16 safetensors) for peers that cannot
read GGUF, such as vLLM:

    python3 benchmarks/make_hf_dir.py /tmp/smollm2_hf            # the embedded default model
    python3 benchmarks/make_hf_dir.py OUT --model path/to/model.gguf

transformers dequantizes the GGUF, but refuses `save_pretrained` on a model loaded from one,
so the weights, config and tokenizer are written here directly. A tied lm_head is left out
(config `tie_word_embeddings` restores it).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="directory to write (must not hold a config.json)")
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    a = ap.parse_args(argv)
    if (a.out / "config.json").exists():
        ap.error(f"{a.out} already holds a config.json; choose an empty directory")
    if a.model is not None and not os.path.isfile(a.model):
        ap.error(f"--model {a.model} is not a file")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if a.model is None:
        from entropic.model.loader import default_model_path

        a.model = default_model_path()
    folder, name = os.path.dirname(os.path.abspath(a.model)), os.path.basename(a.model)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    a.out.mkdir(parents=True, exist_ok=True)
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(a.out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "bfloat16"
    cfg["architectures"] = [type(model).__name__]
    (a.out / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.save_pretrained(a.out)
    print(f"wrote {a.out} ({len(state)} tensors, {type(model).__name__})")


if __name__ == "__main__":
    main()
