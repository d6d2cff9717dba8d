"""Train a Hugging Face GPT-2 with ``transformers.Trainer`` and ZenFlowAdamW, next to AdamW.

The model is built from a config (nothing is downloaded) with bytes as tokens; the text is the
demo's fine-tuning prose (pydoc's help topics). Two runs from the same weights on the same
batches, each through an unmodified ``Trainer``:

* ``zenflow``: ``optimizers=(zenflow.ZenFlowAdamW(...), None)``, the model compiled in place
  with ``model.compile(backend="zenflow")``, ``ZenFlowCallback`` to flush at the end;
* ``adamw``: ``torch.optim.AdamW`` with the same hyperparameters, the model compiled with
  Inductor as zenflow's run is.

Trainer clips both at ``max_grad_norm`` 1.0 (its default) and runs a linear LR schedule. Prints
the train and eval losses of both runs and zenflow's over AdamW's.

    python examples/hf_finetune.py           # about 6 minutes on 2 CPU cores, compiles included
    python examples/hf_finetune.py --quick   # seconds, for the test suite (no Inductor)
"""

import argparse
import logging
import sys
import tempfile
import time

import torch
import transformers
from text_data import topics_prose_bytes, train_val_split

import zenflow
from zenflow.integrations.transformers import ZenFlowCallback

SETTINGS = dict(topk_ratio=0.1, update_interval=4, select_interval=16, overlap_step=True)
QUICK = dict(steps=8, n_layer=1, n_embd=32, block_size=32, eval_blocks=8, inner="eager")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument(
        "--inner", choices=["inductor", "eager"], default="inductor", help="what runs the graphs"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny run for the test suite")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    return args


def blocks(tokens: torch.Tensor, block_size: int) -> list[dict]:
    """Consecutive blocks of ``block_size`` bytes, each its own labels (GPT-2 shifts them)."""
    count = len(tokens) // block_size
    rows = tokens[: count * block_size].reshape(count, block_size)
    return [{"input_ids": row, "labels": row} for row in rows]


def gpt2(args) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=args.block_size,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=max(1, args.n_embd // 64),
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def train(name: str, args, train_set, eval_set, out: str) -> dict:
    model = gpt2(args)
    options = {"inner": args.inner}
    callbacks = []
    if name == "zenflow":
        optimizer = zenflow.ZenFlowAdamW(model.parameters(), lr=args.lr, **SETTINGS)
        model.compile(backend="zenflow", options=options)
        callbacks.append(ZenFlowCallback())
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        if args.inner == "inductor":
            model.compile()
    training = transformers.TrainingArguments(
        output_dir=f"{out}/{name}",
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        seed=0,
        # A live bar on a terminal; in a log file, Trainer's log lines every logging_steps.
        disable_tqdm=not sys.stderr.isatty(),
    )
    trainer = transformers.Trainer(
        model=model,
        args=training,
        train_dataset=train_set,
        eval_dataset=eval_set,
        optimizers=(optimizer, None),
        callbacks=callbacks,
    )
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    metrics = trainer.evaluate()
    return {"train_loss": result.training_loss, "eval_loss": metrics["eval_loss"], "s": seconds}


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    train_tokens, val_tokens = train_val_split(topics_prose_bytes())
    train_set = blocks(train_tokens, args.block_size)
    eval_set = blocks(val_tokens, args.block_size)[: args.eval_blocks]
    with tempfile.TemporaryDirectory() as out:
        results = {
            name: train(name, args, train_set, eval_set, out) for name in ("zenflow", "adamw")
        }
    print(f"{args.steps} steps, batch {args.batch_size} x {args.block_size} bytes, {args.inner}")
    print(f"{'run':8} {'train loss':>10} {'eval loss':>10} {'wall s':>8}")
    for name, r in results.items():
        print(f"{name:8} {r['train_loss']:10.4f} {r['eval_loss']:10.4f} {r['s']:8.1f}")
    ratio = results["zenflow"]["eval_loss"] / results["adamw"]["eval_loss"]
    print(f"eval loss ratio zenflow/adamw: {ratio:.4f}")


if __name__ == "__main__":
    main()
