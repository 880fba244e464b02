"""Export a checkpoint of this repo as a Hugging Face transformers model directory.

    python -m scripts.export_hf --ckpt runs/baseline-4x128 --out hf/baseline-4x128 --check

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("hf/baseline-4x128")      # + trust_remote_code=True for
    tokenizer = AutoTokenizer.from_pretrained("hf/baseline-4x128")         #   the custom variants

model=llama / transformer_llama become a stock LlamaForCausalLM, model=gpt2 a stock GPT2LMHeadModel;
CASTLE, CASTLE-SWL, FoX and the Pro block (and any option a stock class cannot express) an
AttnLMForCausalLM whose self-contained modeling file is written into the directory (trust_remote_code).
The directory is written under a temporary name and renamed at the end: nothing half-written is left.
"""
import argparse

import torch

from model.hf.convert import HF_CLASSES, check_export, export_hf
from model.runtime import user_errors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file, or run directory (its latest checkpoint)")
    p.add_argument("--out", required=True, help="new directory to write (must not exist, or be empty)")
    p.add_argument("--format", default="auto", choices=["auto", "stock", "custom"],
                   help="auto: a stock transformers class when one expresses the model exactly, else the custom "
                        "model; stock: refuse instead of falling back; custom: always the custom model")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="weights' dtype (default: as stored, fp32)")
    p.add_argument("--allow-json-tokenizer", action="store_true",
                   help="export a model trained on JSON-escaped text (data.tokenizer=gpt2_json) with the plain "
                        "GPT-2 tokenizer")
    p.add_argument("--check", action="store_true",
                   help="reload the directory with transformers and compare its logits with ours (fp32, CPU)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    with user_errors():
        dtype = DTYPES.get(args.dtype)
        arch = export_hf(args.ckpt, args.out, args.format, dtype, args.allow_json_tokenizer)
        remote = " (load with trust_remote_code=True)" if arch == "custom" else ""
        print(f"wrote {args.out}: {HF_CLASSES[arch]}{remote}")
        if args.check:
            diff, scale = check_export(args.ckpt, args.out, dtype)
            print(f"check: max |logit difference| {diff:.3g} (max |logit| {scale:.3g})")
            if diff > 1e-4 * max(1.0, scale):
                raise ValueError(f"the exported model's logits differ from the checkpoint's by {diff:.3g}")


if __name__ == "__main__":
    main()
