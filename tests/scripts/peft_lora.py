"""A PEFT LoRA fine-tune of a tiny Llama built from a config (no download): r=8 on q_proj and
v_proj, token ids fed straight to the model, AdamW on the adapters.

    python peft_lora.py --how plain|trace-api|trainer [--steps 30]

plain: a hand-written loop with no TraceML call (for `traceml run`); trace-api: the same loop
inside `traceml.Trace(profile_memory=True)`; trainer: Hugging Face Trainer with TraceML's
callback. Prints PEFT's own count of the parameters as `PEFT {"trainable": ..., "total": ...}`.
"""
import argparse
import contextlib
import json

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, CONTEXT = 128, 16


def tiny_llama():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=CONTEXT)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                           lora_dropout=0.0, task_type="CAUSAL_LM"))


def batches(steps, batch_size):
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        starts = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
        yield (starts + torch.arange(CONTEXT)) % VOCAB


def hand_written_loop(model, steps, trace):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with trace:
        for input_ids in batches(steps, 4):
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def with_trainer(model, steps):
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    from traceml.integrations import huggingface as traceml_hf

    class Rows(Dataset):
        def __init__(self):
            self.rows = list(batches(steps * 4, 1))

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, index):
            return {"input_ids": self.rows[index][0], "labels": self.rows[index][0]}

    traceml_hf.init()
    arguments = TrainingArguments(output_dir="hf_out", per_device_train_batch_size=4, max_steps=steps,
                                  learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                                  dataloader_num_workers=0, disable_tqdm=True, logging_steps=1000)
    Trainer(model=model, args=arguments, train_dataset=Rows(),
            callbacks=[traceml_hf.TraceMLTrainerCallback()]).train()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=("plain", "trace-api", "trainer"), default="plain")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    model = tiny_llama()
    trainable, total = model.get_nb_trainable_parameters()
    print("PEFT " + json.dumps({"trainable": trainable, "total": total}), flush=True)
    if args.how == "trainer":
        with_trainer(model, args.steps)
    elif args.how == "trace-api":
        import traceml

        hand_written_loop(model, args.steps, traceml.Trace(profile_memory=True).trace("fine_tune"))
    else:
        hand_written_loop(model, args.steps, contextlib.nullcontext())


if __name__ == "__main__":
    main()
