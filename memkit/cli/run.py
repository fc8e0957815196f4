"""memkit run: from a recipe to a trained model in one command.

    memkit run presets/recipes/lora-8b-1x4090.yaml --data train.jsonl
    memkit run --model llama-3.1-8b --gpu rtx-4090 --global-batch-size 64 --lora-rank 16 --data train.jsonl
    memkit run --resume runs/lora-8b-1x4090          # continue a run from its newest checkpoint

It plans (`memkit suggest`), writes the bundle (accelerate.yaml, ds_config.json, plan.json,
README.md) and the recipe it ran (recipe.yaml) into --out, prints the plan, its predicted peak and
the `memkit train` command, and runs that command: the same checks and the same processes. It
asks nothing. The data, model and plan are checked before the bundle is written, so a bad recipe
leaves --out as it was.

A recipe is YAML with five sections; each key is the flag of the same name (`--num-gpus` is
budget.num_gpus), and a flag given on the command line wins over the recipe:

    model:    {name, init, trust_remote_code}                # name: --model
    data:     {path, eval_data, eval_fraction, packing, truncate}   # path: --data
    budget:   {gpu, gpu_memory, num_gpus, num_nodes, host_ram}
    work:     {global_batch_size, seq_len, num_epochs, max_steps}
    training: {lr, lr_decay, warmup_steps, weight_decay, seed, lora_rank, lora_targets, quantize_base,
               zero, precision, optimizer, eval_every, save_every, report_to}
    output:   {dir, main_process_port}                       # dir: --out
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from memkit.errors import MemkitError, did_you_mean

HELP = "plan, write the bundle and train in one command, from a recipe YAML or flags (--resume DIR continues)"
RECIPE_FILE = "recipe.yaml"
FROM_DATA = "from-data"


@dataclass(frozen=True, slots=True)
class Key:
    section: str
    name: str
    flag: str
    kind: type
    to: str
    """'suggest' (a planning input), 'train' (a runner flag), 'both', or 'run' (this command's own)."""
    help: str


def _key(section, name, flag, kind, to, help_):
    return Key(section, name, flag, kind, to, help_)


KEYS = (
    _key("model", "name", "--model", str, "both", "catalog name, config.json / folder with weights, or hub id"),
    _key("model", "init", "--init", str, "train", "pretrained (default when the model has weights) or random"),
    _key("model", "trust_remote_code", "--trust-remote-code", bool, "both", "run the model folder's own code "
         "(a config with auto_map), to plan and to train"),
    _key("data", "path", "--data", str, "train", "training data (any `memkit train --data` format)"),
    _key("data", "eval_data", "--eval-data", str, "train", "held-out data for the eval loss"),
    _key("data", "eval_fraction", "--eval-fraction", float, "train", "hold out this fraction of the data"),
    _key("data", "packing", "--packing", str, "train", "isolated (default where the model allows it: each packed "
         "example attends only to itself) / on (packed examples see the earlier ones) / off"),
    _key("data", "truncate", "--truncate", bool, "train", "cut an example longer than seq_len to its first seq_len "
         "tokens (default: refuse it)"),
    _key("budget", "gpu", "--gpu", str, "suggest", "GPU name (memkit gpus)"),
    _key("budget", "gpu_memory", "--gpu-memory", str, "suggest", "GPU memory instead of --gpu, e.g. 24GiB"),
    _key("budget", "num_gpus", "--num-gpus", int, "suggest", "GPUs per node (default 1)"),
    _key("budget", "num_nodes", "--num-nodes", int, "suggest", "nodes (default 1)"),
    _key("budget", "host_ram", "--host-ram", str, "suggest", "host RAM per node"),
    _key("work", "global_batch_size", "--global-batch-size", int, "suggest", "sequences per optimizer step"),
    _key("work", "seq_len", "--seq-len", int, "suggest", "tokens per sequence, or from-data (the default: the "
         "longest tokenized example rounded up to a multiple of 64, memkit.train.data.seq_len_from_data)"),
    _key("work", "num_epochs", "--num-epochs", float, "train", "passes over the data"),
    _key("work", "max_steps", "--max-steps", int, "train", "optimizer steps instead of epochs"),
    _key("training", "lr", "--lr", float, "train", "peak LR (default: 2e-5 full, 2e-4 LoRA; memkit.train.config)"),
    _key("training", "lr_decay", "--lr-decay", str, "train", "cosine, linear or constant"),
    _key("training", "warmup_steps", "--warmup-steps", int, "train", "linear warm-up steps"),
    _key("training", "weight_decay", "--weight-decay", float, "train", "AdamW weight decay"),
    _key("training", "seed", "--seed", int, "train", "random seed"),
    _key("training", "lora_rank", "--lora-rank", int, "suggest", "LoRA rank (0 = full fine-tuning)"),
    _key("training", "lora_targets", "--lora-targets", str, "suggest", "comma-separated module names"),
    _key("training", "quantize_base", "--quantize-base", str, "suggest", "nf4 / fp4: a 4-bit base (QLoRA)"),
    _key("training", "zero", "--zero", int, "suggest", "pin the ZeRO stage"),
    _key("training", "precision", "--precision", str, "suggest", "pin the precision"),
    _key("training", "optimizer", "--optimizer", str, "suggest", "pin the optimizer"),
    _key("training", "eval_every", "--eval-every", int, "train", "eval loss every N steps"),
    _key("training", "save_every", "--save-every", int, "train", "checkpoint every N steps"),
    _key("training", "report_to", "--report-to", str, "train", "where the metrics go (memkit train --report-to)"),
    _key("output", "dir", "--out", str, "run", "bundle folder; the run writes into DIR/run"),
    _key("output", "main_process_port", "--main-process-port", int, "run", "accelerate's rendezvous port"),
)
SECTIONS = tuple(dict.fromkeys(k.section for k in KEYS))
REQUIRED = ("--model", "--data", "--global-batch-size")
ALTERNATIVES = {"max_steps": "num_epochs", "num_epochs": "max_steps", "gpu": "gpu_memory", "gpu_memory": "gpu"}
"""Keys that say the same thing in two ways: a flag given for one replaces the recipe's other."""


def _dest(key: Key) -> str:
    return key.flag[2:].replace("-", "_")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="recipe YAML (presets/recipes/ has examples); flags override it")
    p.add_argument("--resume", dest="resume_run", metavar="DIR",
                   help="continue the run in DIR (what an earlier `memkit run --out DIR` wrote) from its newest "
                        "checkpoint, with the recipe saved there")
    p.add_argument("--dry-run", action="store_true",
                   help="plan, write the bundle and print the command, but do not start training")
    g = p.add_argument_group("recipe keys as flags (SECTION.KEY in the YAML)")
    for key in KEYS:
        if key.kind is bool:  # a switch: the flag alone, `true` in the YAML
            g.add_argument(key.flag, action="store_true", default=None, help=f"{key.section}.{key.name}: {key.help}")
        else:
            g.add_argument(key.flag, type=_seq_len_arg if key.name == "seq_len" else key.kind, default=None,
                           help=f"{key.section}.{key.name}: {key.help}")


def read_recipe(path: str) -> dict:
    """{dest: value} from a recipe file; an unknown section or key is one line naming it."""
    import yaml

    from memkit.fileio import read_text

    try:
        data = yaml.safe_load(read_text(Path(path), what="recipe"))
    except yaml.YAMLError as exc:
        raise MemkitError(f"recipe {path} is not YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise MemkitError(f"recipe {path} is not a mapping of sections ({', '.join(SECTIONS)})")
    out = {}
    for section, body in data.items():
        if section not in SECTIONS:
            raise MemkitError(f"recipe {path}: unknown section {section!r}{did_you_mean(str(section), SECTIONS)}; "
                              f"sections are {', '.join(SECTIONS)}")
        keys = {k.name: k for k in KEYS if k.section == section}
        if not isinstance(body, dict):
            raise MemkitError(f"recipe {path}: section {section} must hold keys ({', '.join(keys)})")
        for name, value in body.items():
            if name not in keys:
                raise MemkitError(f"recipe {path}: unknown key {section}.{name}{did_you_mean(str(name), keys)}; "
                                  f"{section} takes {', '.join(keys)}")
            out[_dest(keys[name])] = _typed(keys[name], value, path)
    return out


def _typed(key: Key, value, path: str):
    if value is None:
        return None
    if key.name == "seq_len" and str(value).strip().lower() == FROM_DATA:
        return FROM_DATA
    if key.name == "packing" and isinstance(value, bool):  # YAML 1.1 reads `on` / `off` as booleans
        return "on" if value else "off"
    if key.kind is str and isinstance(value, (list, tuple)):  # lora_targets: [q_proj, v_proj]
        return ",".join(str(v) for v in value)
    if key.kind is bool:
        if not isinstance(value, bool):
            raise MemkitError(f"recipe {path}: {key.section}.{key.name} {value!r} must be true or false")
        return value
    try:
        if key.kind is int and (isinstance(value, bool) or float(value) != int(value)):
            raise ValueError
        return key.kind(value)
    except (TypeError, ValueError):
        raise MemkitError(f"recipe {path}: {key.section}.{key.name} {value!r} must be "
                          f"{'an integer' if key.kind is int else 'a number' if key.kind is float else 'text'}") from None


def merged(args: argparse.Namespace) -> dict:
    """The recipe's values, then every flag given on the command line over them."""
    values = read_recipe(args.recipe) if args.recipe else {}
    for key in KEYS:
        given = getattr(args, _dest(key))
        if given is not None:
            values[_dest(key)] = given
            other = ALTERNATIVES.get(_dest(key))
            if other and getattr(args, other) is None:  # --max-steps on a recipe of epochs: the flag's unit wins
                values.pop(other, None)
    steps, every = values.get("max_steps"), values.get("eval_every")
    if steps is not None and every and every > steps and args.eval_every is None:
        # a shorter run than the recipe's eval cadence: its eval at the end (memkit.validate refuses
        # --eval-every past --max-steps when the user passed both)
        values["eval_every"] = 0
        print(f"memkit: the recipe's training.eval_every {every} is beyond --max-steps {steps}: the eval loss "
              "is taken at the end only (--eval-every N for another cadence)", file=sys.stderr)
    return values


def to_recipe(values: dict) -> dict:
    """{dest: value} back to sections (what recipe.yaml beside the run holds)."""
    out: dict = {}
    for key in KEYS:
        if values.get(_dest(key)) is not None:
            out.setdefault(key.section, {})[key.name] = values[_dest(key)]
    return out


def _argv(values: dict, to: tuple[str, ...]) -> list[str]:
    out = []
    for key in KEYS:
        value = values.get(_dest(key))
        if key.to in to and value is not None and value is not False:
            out += [key.flag] if value is True else [key.flag, str(value)]
    return out


def default_out(values: dict, recipe: str | None) -> str:
    name = Path(recipe).stem if recipe else Path(str(values["model"])).name
    return str(Path("runs") / name)


def run(args: argparse.Namespace) -> int:
    if args.resume_run:
        return _resume(args)
    values = merged(args)
    missing = [flag for flag in REQUIRED if values.get(flag[2:].replace("-", "_")) is None]
    if missing:
        where = f"recipe {args.recipe} has no " if args.recipe else "no "
        keys = ", ".join(f"{k.section}.{k.name} ({k.flag})" for k in KEYS if k.flag in missing)
        raise MemkitError(f"{where}{keys}; add it to the recipe or pass the flag")
    if not values.get("gpu") and not values.get("gpu_memory"):
        raise MemkitError("no GPU: set budget.gpu (--gpu, see `memkit gpus`) or budget.gpu_memory (--gpu-memory)")
    from memkit.validate import check_data

    check_data(values["data"], seq_len=values["seq_len"] if isinstance(values.get("seq_len"), int) else None)
    if values.get("seq_len") in (None, FROM_DATA):
        values["seq_len"] = _seq_len_from_data(values)
    out = values.pop("out", None) or default_out(values, args.recipe)
    return _plan_and_train(values, out, args)


def _seq_len_arg(text: str) -> int | str:
    """--seq-len N or --seq-len from-data."""
    if text.strip().lower() == FROM_DATA:
        return FROM_DATA
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or {FROM_DATA}") from None


def _seq_len_from_data(values: dict) -> int:
    """The sequence length the data needs, tokenized by the tokenizer the run will use (the model
    folder's, else memkit's byte tokenizer: memkit.train.main.prepare); said in one line."""
    from memkit.train.data import seq_len_from_data
    from memkit.train.model import load_config, max_positions, resolve_model
    from memkit.train.tokenizer import load_tokenizer

    source = resolve_model(str(values["model"]))
    config = load_config(source)
    seq_len, line = seq_len_from_data(values["data"], load_tokenizer(source.folder, vocab_size=config.vocab_size),
                                      max_positions=max_positions(config))
    print(f"memkit: {line}", file=sys.stderr)
    return seq_len


def _plan_and_train(values: dict, out: str, args: argparse.Namespace) -> int:
    import os
    import tempfile

    from memkit.cli import suggest
    from memkit.emit import plan_doc
    from memkit.emit.bundle import bundle_files, write_bundle
    from memkit.emit.deepspeed import largest_param_numel
    from memkit.planner import NoPlanFits, search
    from memkit.train.config import default_lr
    from memkit.validate import check_args, check_output_dir

    check_output_dir(out, what="--out")
    parser = argparse.ArgumentParser(add_help=False)
    suggest.add_arguments(parser)
    planning = parser.parse_args(_argv(values, ("suggest", "both")))
    check_args(planning)
    request = suggest.request_from_args(planning)
    try:
        result = search(request)
    except NoPlanFits as exc:
        planning.json, planning.out = False, None
        return suggest._report_no_fit(planning, request, exc)
    lr = values.get("lr") or default_lr(request.lora_rank)[0]
    doc = plan_doc.build(result, lr=lr)
    out_dir = os.path.abspath(os.path.expanduser(out))
    doc["model"] = suggest._absolute_if_path(values["model"], doc["model"])
    files = bundle_files(doc, out_dir=out_dir, largest_param_numel=largest_param_numel(request.model))
    saved = {**values, "out": out_dir}
    files[RECIPE_FILE] = _recipe_text(saved)
    # the run's checks (data rows, model, plan flags) against the plan, before --out is touched
    with tempfile.TemporaryDirectory(prefix="memkit-run-") as tmp:
        (Path(tmp) / "plan.json").write_text(files["plan.json"], encoding="utf-8")
        train_args = _train_namespace(values, doc, plan=str(Path(tmp) / "plan.json"), out_dir=out_dir,
                                      port=values.get("main_process_port"))
        from memkit.cli import train

        check_args(train_args)
        train.check(train_args)
    from memkit.cli.explain import render_document

    print(render_document(doc))
    written = write_bundle(out_dir, files)
    train_args.plan = f"{out_dir}/plan.json"
    return _start(train_args, values, doc, out_dir, written=written, dry_run=args.dry_run)


def _recipe_text(values: dict) -> str:
    import yaml

    return ("# the recipe `memkit run` ran (flags merged in); `memkit run --resume DIR` continues it\n"
            + yaml.safe_dump(to_recipe(values), sort_keys=False))


def _train_argv(values: dict, doc: dict, *, plan: str, out_dir: str, port: int | None) -> list[str]:
    """`memkit train` arguments for the recipe: the plan, the weights (a catalog name's hub id unless
    --init random, memkit.emit.bundle.model_argument), the runner's flags, the rendezvous port."""
    from memkit.emit.accelerate import DEFAULT_MAIN_PROCESS_PORT
    from memkit.emit.bundle import model_argument

    weights = str(doc["model"]) if values.get("init") == "random" else model_argument(doc)
    argv = ["--plan", plan, "--model", weights, "--output-dir", f"{out_dir}/run"]
    argv += [a for a in _argv({k: v for k, v in values.items() if k != "model"}, ("train",))]
    return argv + ["--main-process-port", str(port or DEFAULT_MAIN_PROCESS_PORT)]


def _train_namespace(values: dict, doc: dict, *, plan: str, out_dir: str, port: int | None,
                     extra: tuple[str, ...] = ()) -> argparse.Namespace:
    from memkit.cli import train

    parser = argparse.ArgumentParser(prog="memkit train", add_help=False)
    train.add_arguments(parser)
    ns = parser.parse_args(_train_argv(values, doc, plan=plan, out_dir=out_dir, port=port) + list(extra))
    ns.command = "train"
    return ns


def _start(train_args: argparse.Namespace, values: dict, doc: dict, out_dir: str, *, written, dry_run: bool,
           extra: tuple[str, ...] = ()) -> int:
    from memkit.cli import train
    from memkit.units import GIB

    est, speed = doc["estimate"], doc["step_time"]
    print(f"\npredicted peak per GPU: {est['nvidia_smi_peak_bytes'] / GIB:.1f} GiB of "
          f"{est['device_total_bytes'] / GIB:.1f} GiB (as nvidia-smi shows it); predicted "
          f"{speed['tokens_per_s']:,.0f} tokens/s")
    if written:
        print("wrote " + ", ".join(str(p) for p in written))
    argv = _train_argv(values, doc, plan=f"{out_dir}/plan.json", out_dir=out_dir,
                       port=values.get("main_process_port")) + list(extra)
    print("\nRun it: memkit train " + " ".join(shlex.quote(a) for a in argv))
    sys.stdout.flush()
    if dry_run:
        return 0
    return train.launch(train_args)


def _resume(args: argparse.Namespace) -> int:
    from memkit.cli import train
    from memkit.emit import plan_doc

    folder = Path(args.resume_run)
    recipe = folder / RECIPE_FILE
    if not recipe.is_file():
        raise MemkitError(f"--resume {args.resume_run}: no {RECIPE_FILE} there; pass the folder an earlier "
                          "`memkit run --out DIR` wrote")
    if args.recipe or any(getattr(args, _dest(k)) is not None for k in KEYS):
        raise MemkitError("--resume DIR continues the recipe saved in DIR as it was; drop the recipe and the "
                          "other flags (or start a new run with --out)")
    values = read_recipe(str(recipe))
    out_dir = str(values.pop("out", None) or folder.resolve())
    doc = plan_doc.read(Path(out_dir) / "plan.json").data
    train_args = _train_namespace(values, doc, plan=f"{out_dir}/plan.json", out_dir=out_dir,
                                  port=values.get("main_process_port"), extra=("--resume",))
    from memkit.validate import check_args

    check_args(train_args)
    train.check(train_args)
    return _start(train_args, values, doc, out_dir, written=[], dry_run=args.dry_run, extra=("--resume",))
