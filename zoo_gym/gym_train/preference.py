"""Preference stages through TRL: dpo (``DPOTrainer``), kto (``KTOTrainer``), orpo (experimental ORPO),
simpo (experimental CPO with ``loss_type="simpo"`` and ``cpo_alpha=0``, as in the SimPO paper).

Pairs (``chosen``/``rejected``, see formats.py) train as TRL's conversational prompt/chosen/rejected rows;
KTO trains on prompt/completion/label rows, a pair giving one desirable and one undesirable row. LoRA
trains with ``ref_model=None`` (TRL's reference is the adapter as initialised, i.e. the base); full
fine-tuning lets TRL load its own copy of the base. ``beta``/``loss_type`` None keep TRL's defaults.
Held-out pairs measure preference accuracy and margin before and after (preference_eval.py), and the
held-out desirable answers the loss.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import time

from zoo_gym.evaluation.chat import prompt_messages
from zoo_gym.evaluation.evaluate import Evaluator, load_tokenizer
from zoo_gym.evaluation.preference_eval import preference_report

from .common import (TrainResult, common_training_args, load_training_model, quiet_libraries, quiet_trainer,
                     round_metadata, split_heldout)
from .config import TrainConfig
from .delta import load_base_state
from .finetuning import delta_of, prepare
from .formats import check_stage_data
from .optimizers import trainer_optimizers
from .preference_losses import loss_types


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def pair_rows(examples: list[dict]):
    """TRL's conversational preference rows of the pairs in ``examples``."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": prompt_messages(ex), "chosen": _assistant(ex["chosen"]),
                               "rejected": _assistant(ex["rejected"])} for ex in examples])


def desirable_answers(examples: list[dict]) -> list[tuple[dict, str, bool]]:
    """(record, answer, desirable) of every answer: a pair's chosen (True) then rejected (False), or a
    KTO record's output and label."""
    out = []
    for ex in examples:
        if "chosen" in ex:
            out += [(ex, ex["chosen"], True), (ex, ex["rejected"], False)]
        else:
            out.append((ex, ex["output"], bool(ex["label"])))
    return out


def kto_rows(examples: list[dict]):
    """TRL's conversational unpaired rows (prompt, completion, label)."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": prompt_messages(ex), "completion": _assistant(answer), "label": good}
                              for ex, answer, good in desirable_answers(examples)])


def _measure(model, tokenizer, held: list[dict] | None) -> dict:
    """Preference accuracy/margin on the held-out pairs and loss on the held-out desirable answers."""
    if not held:
        return {"preference_accuracy": None, "preference_margin": None, "loss": None}
    keep = ("instruction", "input", "system", "history")
    answers = [{**{k: ex[k] for k in keep if k in ex}, "output": a} for ex, a, good in desirable_answers(held)
               if good]
    report = preference_report(model, tokenizer, held) or {}
    loss = Evaluator(None, answers, model=model, tokenizer=tokenizer).loss() if answers else None
    return {"preference_accuracy": report.get("preference_accuracy"),
            "preference_margin": report.get("preference_margin"), "loss": loss,
            "preference_pairs": report.get("preference_pairs", 0)}


def _stage_args(cfg: TrainConfig) -> dict:
    """The stage's own config fields: max_length, beta and loss_type where set (else TRL's defaults)."""
    kw = {"max_length": cfg.max_length}
    if cfg.beta is not None:
        kw["beta"] = cfg.beta
    names = loss_types(cfg.stage, cfg.loss_type)
    if cfg.stage == "dpo" and names:
        kw["loss_type"] = names
        if "exo_pair" in names:
            kw["label_smoothing"] = 1e-3  # EXO needs a non-zero epsilon; TRL's recommended value
    elif cfg.stage == "kto" and names:
        kw["loss_type"] = names[0]
    elif cfg.stage == "simpo":
        kw.update(loss_type="simpo", cpo_alpha=0.0)  # SimPO: no behaviour-cloning term
    if cfg.stage in ("orpo", "simpo"):
        kw["remove_unused_columns"] = False  # their collator reads the tokenized columns (TRL says so otherwise)
    return kw


def _trainer(model, tokenizer, train_ex: list[dict], cfg: TrainConfig, tmp: str, progress: bool):
    """The TRL trainer of ``cfg.stage``, ready to train."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # before trl.experimental is first imported
    args = {**common_training_args(cfg, tmp, progress=progress), **_stage_args(cfg)}
    if cfg.stage == "dpo":
        from trl import DPOConfig as Config, DPOTrainer as Trainer
    elif cfg.stage == "kto":
        from trl import KTOConfig as Config, KTOTrainer as Trainer
    elif cfg.stage == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
    data = kto_rows(train_ex) if cfg.stage == "kto" else pair_rows(train_ex)
    extra = {"ref_model": None} if cfg.stage in ("dpo", "kto") else {}
    trainer = Trainer(model=model, args=Config(**args), train_dataset=data, processing_class=tokenizer,
                      optimizers=trainer_optimizers(model, cfg), **extra)
    quiet_trainer(trainer, progress)
    return trainer


def _drop_reference_adapter(model) -> None:
    """TRL trains a PEFT model against a frozen copy of its adapter named 'ref': not part of the delta."""
    if "ref" in (getattr(model, "peft_config", None) or {}):
        model.delete_adapter("ref")


def train_preference(base_dir, examples, config: TrainConfig, *, base_sha256: str, eval_examples=None,
                     progress: bool = False) -> TrainResult:
    from transformers import set_seed

    check_stage_data(config.stage, examples)
    quiet_libraries(progress)
    set_seed(config.seed)
    base_dir = pathlib.Path(base_dir)
    train_ex, held = split_heldout(examples, eval_examples)
    names, base_state = load_base_state(base_dir)
    tokenizer = load_tokenizer(base_dir)
    tokenizer.padding_side = "right"
    model = load_training_model(base_dir, config)
    before = _measure(model, tokenizer, held)

    model, initial = prepare(model, config)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"zoo_gym_{config.stage}_") as tmp:
        trainer = _trainer(model, tokenizer, train_ex, config, tmp, progress)
        trainer.train()
    seconds = time.perf_counter() - t0
    model = trainer.model
    _drop_reference_adapter(model)
    model.eval()
    after = _measure(model, tokenizer, held)

    delta = delta_of(model, config, base_state, names, initial=initial)
    steps = int(trainer.state.global_step)
    meta = round_metadata(config, delta, base_sha256=base_sha256, **{
        "steps": steps,
        "examples_seen": steps * config.batch_size * config.gradient_accumulation_steps,
        "tokens_seen": int(trainer.state.num_input_tokens_seen),
        "train_seconds": round(seconds, 3),
        "loss_before": before["loss"],  # held-out desirable answers (a pair's chosen)
        "loss_after": after["loss"],
        "preference_accuracy_before": before["preference_accuracy"],
        "preference_accuracy_after": after["preference_accuracy"],
        "preference_margin_before": before["preference_margin"],
        "preference_margin_after": after["preference_margin"],
        "preference_pairs": after.get("preference_pairs", 0),
        "heldout_examples": len(held) if held else 0,
        "beta": config.beta,
        "loss_type": config.loss_type,
    })
    return TrainResult(delta=delta, base_sha256=base_sha256, metadata=meta)
