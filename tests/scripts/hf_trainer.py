"""A tiny GPT-2 (about 100k parameters, built from a config: no hub) under Hugging Face Trainer."""
import argparse
import json
import time

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(Dataset):
    def __init__(self, count, length, vocab):
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=("callback", "trainer", "seed", "none"), default="callback")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--collate-ms", type=float, default=0.0, help="sleep per batch in collate")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate every N updates")
    parser.add_argument("--eval-rows", type=int, default=256, help="rows in the evaluation set")
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N updates")
    parser.add_argument("--output-dir", default="hf_out")
    parser.add_argument("--save", help="save the trained model here (save_model and torch.save)")
    parser.add_argument("--fsdp", action="store_true", help="shard each GPT2Block with Trainer's FSDP2")
    args = parser.parse_args()

    if args.fsdp:
        from cpu_fsdp import let_accelerate_shard_on_cpu

        let_accelerate_shard_on_cpu()
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)

    def collate(rows):
        if args.collate_ms:
            time.sleep(args.collate_ms / 1000.0)
        input_ids = torch.stack([row["input_ids"] for row in rows])
        return {"input_ids": input_ids, "labels": input_ids}

    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=args.accumulate, max_steps=args.max_steps, learning_rate=1e-3,
        logging_steps=10, save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or 500, report_to=[], use_cpu=True, dataloader_num_workers=0,
        eval_strategy="steps" if args.eval_every else "no", eval_steps=args.eval_every or None,
        disable_tqdm=True,
        **(dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                        "reshard_after_forward": True})
           if args.fsdp else {}))
    kwargs = dict(model=model, args=training, train_dataset=Tokens(4096, 32, 128),
                  eval_dataset=Tokens(args.eval_rows, 32, 128) if args.eval_every else None, data_collator=collate)
    if args.how == "callback":
        from traceml.integrations import huggingface as traceml_hf

        traceml_hf.init()
        trainer = Trainer(**kwargs, callbacks=[traceml_hf.TraceMLTrainerCallback()])
    elif args.how == "seed":  # the seed's snippet, as its users wrote it
        from traceml_ai.integrations import huggingface as traceml_hf

        traceml_hf.init()
        trainer = Trainer(**kwargs, callbacks=[traceml_hf.TraceMLTrainerCallback()])
    elif args.how == "trainer":
        import traceml

        trainer = traceml.hf_decorators.TraceMLTrainer(**kwargs)
    else:
        trainer = Trainer(**kwargs)
    # The script's own measure of its checkpoints: each save, timed around Trainer's own.
    save_times = []

    def timed_save_checkpoint(*args, **kwargs):
        started = time.perf_counter()
        try:
            return type(trainer)._save_checkpoint(trainer, *args, **kwargs)
        finally:
            save_times.append(time.perf_counter() - started)

    trainer._save_checkpoint = timed_save_checkpoint
    trainer.train()
    if args.fsdp:
        # One string, one write: both ranks print to one stdout, and print()'s separate arguments interleave.
        sharded = sum(hasattr(p, "_local_tensor") for p in trainer.model_wrapped.parameters())
        print(f"sharded parameters: {sharded}")
    print("trained", trainer.state.global_step, "updates")
    evaluations = [entry["eval_runtime"] for entry in trainer.state.log_history if "eval_runtime" in entry]
    print("MEASURED " + json.dumps({"eval_s": sum(evaluations), "evaluations": len(evaluations),
                                    "save_s": sum(save_times), "saves": len(save_times)}), flush=True)
    if args.save:
        trainer.save_model(args.save)
        torch.save(model, f"{args.save}/model.pt")


if __name__ == "__main__":
    main()
