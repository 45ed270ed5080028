"""Build the embedded demo pair: a small Qwen3 code model trained on the Python stdlib, and its DFlash drafter.

Stages (each cached in --work, so `--stage prep` can run on a CPU box and the rest on a GPU):
  prep:   corpus from `sysconfig.get_paths()["stdlib"]` (*.py, site-packages excluded); files whose
          sha1(relative path) mod 20 == 0 are held out; a byte-level BPE tokenizer (`tokenizers`) with
          reserved special tokens (`<|endoftext|>`, `<|pad|>`, `<|MASK|>`, chat roles) and a chat template;
          the training files tokenised into one uint16 stream.
  target: a Qwen3 trained from scratch for `target_epochs` passes (next-token loss; a quarter of the sequences
          are wrapped in the chat template as "continue this code" turns so chat-mode prompts work); saved in
          bf16, with its held-out loss. 8 epochs had the lowest held-out loss of 3 / 8 / 20
          (dflash_zoo/demo/PROVENANCE.md); targets that memorise more are harder to draft for.
  draft:  `python -m dflash_zoo train --regenerate` (the CLI's own code path): the target continues code
          prefixes (raw) and chat prompts, greedy; the drafter learns those responses. With --ablations the
          docs/ablations.md variants train in parallel processes on the same regenerated data (on
          --ablation-device when given, e.g. the second GPU). `--stage draft` reruns only this stage and eval
          for the target already in --out.
  eval:   `python -m dflash_zoo eval --json` on held-out stdlib files (greedy, block 16).
Outputs land in --out: target/, draft/, PROVENANCE.md, results.json (and ablations.json).

    python scripts/build_demo_pair.py --stage prep                    # CPU: corpus + tokenizer
    python scripts/build_demo_pair.py --ablations --out $OUT/demo     # GPU: the rest
    python scripts/build_demo_pair.py --stage draft --ablations --ablation-device cuda:1 --out dflash_zoo/demo
    python scripts/build_demo_pair.py --stage draft --init dflash_zoo/demo/draft --set data_seed=3 ...  # continue
    python scripts/build_demo_pair.py --tiny --out /tmp/demo          # CPU smoke test, all stages
The shipped drafter is a from-scratch run continued on fresh prompts several times (`--init`, a new `data_seed`
each time); dflash_zoo/demo/PROVENANCE.md gives the commands.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|MASK|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIALS += [f"<|reserved_{i}|>" for i in range(9)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
FULL = dict(vocab=8192, hidden=256, layers=6, inter=768, heads=4, kv=2, seq=512, batch=64, lr=2e-3,
            target_epochs=8.0, draft_s=330, abl_s=300, draft_layers=3, n_text=24000, n_chat=4000, eval_n=30,
            draft_batch=64, anchors=48, regen_batch=8192, site_share=0.6, data_seed=1, abl_steps=0)  # fmt: skip
TINY = dict(vocab=600, hidden=64, layers=4, inter=128, heads=4, kv=2, seq=128, batch=8, lr=3e-3,
            target_epochs=2.0, draft_s=20, abl_s=10, draft_layers=2, n_text=24, n_chat=8, eval_n=3,
            draft_batch=8, anchors=16, regen_batch=64, site_share=0.5, data_seed=1, abl_steps=0)  # fmt: skip
DEMO_PROMPT = "def read_lines(path):"  # the README's main command
T0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def corpus_files() -> tuple[Path, list[str], list[str]]:
    """(stdlib root, training files, held-out files) as sorted relative paths."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.parts)
    )
    held = [r for r in rel if int(hashlib.sha1(r.encode()).hexdigest(), 16) % 20 == 0]
    return root, [r for r in rel if r not in set(held)], held


def read(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8", errors="replace")


def prep(work: Path, hp: dict, tiny: bool) -> None:
    """Tokenizer + token stream + file lists into `work` (skipped when present).

    A tokenizer already in `work/tokenizer` (e.g. the shipped target's, to retrain only the target) is kept.
    """
    if (work / "tokens.bin").is_file():
        return
    from transformers import AutoTokenizer

    root, train, held = corpus_files()
    if tiny:
        train, held = train[:40], held[:4]
    if not (work / "tokenizer").is_dir():
        train_tokenizer(root, train, hp["vocab"]).save_pretrained(work / "tokenizer")
    fast = AutoTokenizer.from_pretrained(work / "tokenizer")
    import numpy as np

    eos = fast.convert_tokens_to_ids("<|endoftext|>")
    encs = fast.backend_tokenizer.encode_batch([read(root, r) for r in train])  # parallel
    ids = [t for enc in encs for t in enc.ids + [eos]]
    np.asarray(ids, dtype=np.uint16).tofile(work / "tokens.bin")
    meta = {
        "stdlib": str(root),
        "python": platform.python_version(),
        "train_files": len(train),
        "held_out": held,
        "tokens": len(ids),
    }
    (work / "corpus.json").write_text(json.dumps({**meta, "train": train}, indent=1))
    say(f"prep: {len(train)} train files, {len(held)} held out, {len(ids):,} tokens, vocab {len(fast)}")


def train_tokenizer(root: Path, train: list[str], vocab: int):
    """Byte-level BPE over the training files, with the reserved specials and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((read(root, r) for r in train), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIALS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def corpus_lists(work: Path) -> None:
    """corpus.json with the train / held-out file lists only (what `--stage draft` needs, no tokenizer)."""
    if (work / "corpus.json").is_file():
        return
    root, train, held = corpus_files()
    meta = {"stdlib": str(root), "python": platform.python_version(), "held_out": held, "train": train}
    (work / "corpus.json").write_text(json.dumps(meta, indent=1))


def chat_wrap(tok, chunk: list[int], rng: random.Random) -> list[int]:
    """A "continue this code" chat turn around a token chunk, rendered exactly like the template."""
    cut = rng.randint(8, max(9, len(chunk) // 3))
    head, tail = tok.encode("<|user|>\n"), tok.encode("<|end|>\n<|assistant|>\n")
    body = head + chunk[:cut] + tail + chunk[cut:]
    return (body[: len(chunk) - 1] + tok.encode("<|end|>"))[: len(chunk)]


def train_target(work: Path, out: Path, hp: dict, device: str) -> dict:
    """Next-token training of a fresh Qwen3 for `target_epochs` passes over the corpus (cosine); saved in bf16.

    The epoch count sets how much the target memorises: the first builds ran 48 epochs (train loss 0.17) and
    their greedy output on unseen code was erratic, which caps what any drafter can anticipate.
    """
    import numpy as np
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(work / "tokenizer")
    data = torch.from_numpy(np.fromfile(work / "tokens.bin", dtype=np.uint16).astype(np.int64))
    eos, end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|end|>")
    cfg = Qwen3Config(vocab_size=hp["vocab"], hidden_size=hp["hidden"], intermediate_size=hp["inter"], num_hidden_layers=hp["layers"],
                      num_attention_heads=hp["heads"], num_key_value_heads=hp["kv"], head_dim=hp["hidden"] // hp["heads"],
                      max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=[eos, end],
                      pad_token_id=tok.pad_token_id, bos_token_id=eos)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    seq, bs, t0, loss = hp["seq"], hp["batch"], time.time(), None
    steps = max(1, round(hp["target_epochs"] * len(data) / (bs * seq)))
    amp = (
        torch.autocast("cuda", torch.bfloat16)
        if device.startswith("cuda")
        else torch.autocast("cpu", enabled=False)
    )
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (bs,), generator=gen)
        rows = [data[s : s + seq + 1].tolist() for s in starts.tolist()]
        rows = [chat_wrap(tok, r, rng) if i % 4 == 0 else r for i, r in enumerate(rows)]
        x = torch.tensor(rows, device=device)  # [bs, seq+1]
        lr = hp["lr"] * min(1.0, step / 100) * 0.5 * (1 + np.cos(np.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        with amp:
            logits = model(input_ids=x[:, :-1]).logits  # [bs, seq, V]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 200 == 0:
            say(f"target step {step + 1}/{steps} loss {loss.item():.3f}")
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = [eos, end]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    n = sum(p.numel() for p in model.parameters())
    info = {
        "epochs": hp["target_epochs"],
        "steps": steps,
        "seconds": round(time.time() - t0, 1),
        "final_loss": round(loss.item(), 3),
        "params": n,
        "tokens_seen": steps * bs * seq,
    }
    say(f"target: {info}")
    return info


def target_report(work: Path, out: Path, hp: dict, device: str) -> dict:
    """Held-out next-token loss of the target (the epoch count is chosen by it) and its greedy demo output."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _, _ = corpus_files()
    held = json.loads((work / "corpus.json").read_text())["held_out"]
    tok = AutoTokenizer.from_pretrained(out / "target")
    model = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).to(device).eval()
    total, count, seq = 0.0, 0, hp["seq"]
    with torch.no_grad():
        for rel in held:
            ids = torch.tensor(tok.encode(read(root, rel)), device=device)
            for chunk in ids.split(seq + 1):  # non-overlapping windows of the file
                if len(chunk) < 2:
                    continue
                logits = model(input_ids=chunk[None, :-1]).logits[0]  # [n, V]
                total += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
                count += len(chunk) - 1
        prompt = tok(DEMO_PROMPT, return_tensors="pt").input_ids.to(device)
        sample = model.generate(prompt, max_new_tokens=64, do_sample=False)[0, prompt.shape[1] :]
    report = {"held_out_loss": round(total / max(count, 1), 3), "held_out_tokens": count}
    say(f"target report: {report}")
    return {**report, "sample": tok.decode(sample)}


def site_files() -> list[Path]:
    """Installed third-party `*.py` files (site-packages): novel code for the target, never in its corpus."""
    roots = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    return sorted({f for r in roots if r.is_dir() for f in r.rglob("*.py") if f.stat().st_size > 2000})


def write_data(work: Path, hp: dict) -> tuple[Path, Path]:
    """Drafter prompts (code prefixes, raw + chat) and held-out eval lines.

    Prompts come from the target's training files and, for `site_share` of them, from site-packages code the
    target never saw: its greedy continuations there look like those on held-out files (the first builds,
    trained on stdlib prefixes only, overfitted: tau 6 on training sequences, 1.7 on unseen ones).
    """
    root, train, held = corpus_files()
    meta = json.loads((work / "corpus.json").read_text())
    train, held = meta["train"], meta["held_out"]
    site = site_files() if hp.get("site_share") else []
    rng = random.Random(hp["data_seed"])
    lines = []
    for i in range(hp["n_text"] + hp["n_chat"]):
        novel = site and rng.random() < hp["site_share"]
        text = rng.choice(site).read_text(errors="replace") if novel else read(root, rng.choice(train))
        start = rng.randrange(max(1, len(text) - 1500))
        chunk = text[start : start + 1500]
        lines.append({"text": chunk} if i < hp["n_text"] else {"prompt": chunk[:200]})
    meta["site_files"] = len(site)
    (work / "corpus.json").write_text(json.dumps(meta, indent=1))
    data = work / "draft_data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ev, rng = [], random.Random(2)
    for rel in held:  # one chunk per held-out file, at a seeded offset
        text = read(root, rel)
        if len(text) > 600:
            start = rng.randrange(len(text) - 600)
            ev.append({"text": text[start : start + 3000], "file": rel})
    ev = ev[: hp["eval_n"]]
    held_path = work / "held_out.jsonl"
    held_path.write_text("".join(json.dumps(x) + "\n" for x in ev))
    return data, held_path


VARIANTS = {  # name -> extra train flags (docs/ablations.md)
    "kv_injection_b16": [],
    "no_target_features_b16": ["--no-target-features"],
    "uniform_blocks_b16": ["--uniform-blocks"],
    "uniform_weights_b16": ["--uniform-loss-weights"],
    "kv_injection_b8": ["--block-size", "8"],
}


def train_cmd(
    target: Path, data: Path, out: Path, hp: dict, device: str, seconds: float, extra: list[str]
) -> list[str]:
    return [sys.executable, "-m", "dflash_zoo", "train", "--target", str(target), "--data", str(data), "--out", str(out),
            "--regenerate", "--max-new-tokens", str(hp.get("regen_tokens", 256)), "--regen-batch-size", str(hp["regen_batch"]),
            "--draft-layers", str(hp["draft_layers"]), "--batch-size", str(hp["draft_batch"]),
            "--anchors-per-seq", str(hp["anchors"]), "--epochs", "1000",
            "--time-budget", str(seconds), "--device", device, "--seed", "0", "--json", *extra]  # fmt: skip


def eval_cmd(target: Path, draft: Path, held: Path, device: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "dflash_zoo", "eval", "--target", str(target), "--draft", str(draft), "--data", str(held),
            "--max-new-tokens", "256", "--device", device, "--json", *extra]  # fmt: skip


def run_all(cmds: dict[str, list[str]], env: dict, logdir: Path) -> dict[str, dict]:
    """Run commands in parallel processes; parse each one's JSON stdout (errors are recorded, not raised)."""
    procs = {}
    for name, cmd in cmds.items():
        say(f"start {name}: {' '.join(cmd[2:])}")
        procs[name] = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=open(logdir / f"{name}.log", "w"), text=True
        )
    out = {}
    for name, p in procs.items():
        stdout, _ = p.communicate()
        try:
            out[name] = json.loads(stdout)
        except json.JSONDecodeError:
            out[name] = {"error": f"exit {p.returncode}; see {name}.log"}
        say(f"done {name}: {str(out[name])[:300]}")
    return out


def drafters(
    work: Path,
    out: Path,
    hp: dict,
    device: str,
    abl_device: str,
    ablations: bool,
    data: Path,
    init: Path | None = None,
) -> tuple[dict, dict]:
    """Main drafter, from `init` when given (+ ablations in parallel once the regenerated data is cached)."""
    env = {**os.environ, "DFLASH_ZOO_HOME": str(work / "home"), "PYTHONUNBUFFERED": "1"}
    target, runs = out / "target", work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    first = run_all(
        {"regen": train_cmd(target, data, runs / "warm", hp, device, 1, ["--steps", "1"])}, env, runs
    )
    main_flags = ["--init", str(init)] if init else []
    cmds = {"main": train_cmd(target, data, runs / "main", hp, device, hp["draft_s"], main_flags)}
    if ablations:
        # abl_steps > 0: every variant takes the same number of steps (abl_s still caps the time)
        same = ["--steps", str(hp["abl_steps"])] if hp["abl_steps"] else []
        cmds |= {
            n: train_cmd(target, data, runs / n, hp, abl_device, hp["abl_s"], f + same)
            for n, f in VARIANTS.items()
        }
    res = run_all(cmds, env, runs)
    res["regen"] = first["regen"]
    (out / "draft").mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors", "training_args.json"):  # not the -checkpoint sibling
        shutil.copy(runs / "main" / name, out / "draft" / name)
    return res, env


def evaluate_all(
    work: Path, out: Path, held: Path, device: str, abl_device: str, names: list[str], env: dict
) -> dict:
    """Held-out eval of the main drafter (with the autoregressive baseline) and of each ablation."""
    cmds = {"main": eval_cmd(out / "target", out / "draft", held, device, [])}
    cmds |= {
        n: eval_cmd(out / "target", work / "runs" / n, held, abl_device, ["--no-baseline"]) for n in names
    }
    res = run_all({f"eval-{k}": v for k, v in cmds.items()}, env, work / "runs")
    return {k.removeprefix("eval-"): v for k, v in res.items()}


def provenance(out: Path, work: Path, hp: dict, info: dict) -> None:
    meta = json.loads((work / "corpus.json").read_text())
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    ev = info["eval"].get("main", {})
    lines = [
        "# Demo pair provenance", "",
        "Built by `scripts/build_demo_pair.py` (see its docstring for the stages).", "",
        f"- corpus: Python {meta['python']} standard library `*.py` ({meta['stdlib']}, site-packages excluded): "
        f"{meta['train_files']} training files, {meta['tokens']:,} tokens",
        f"- held out: {len(meta['held_out'])} files with sha1(relative path) % 20 == 0 (list below)",
        f"- tokenizer: byte-level BPE, vocab {hp['vocab']}, specials {', '.join(SPECIALS[:7])} (+ reserved)",
        f"- target: Qwen3, hidden {hp['hidden']}, {hp['layers']} layers, tied embeddings, bf16; {json.dumps(info['target'])}",
        f"- target held-out loss: {info['target_report']['held_out_loss']} over {info['target_report']['held_out_tokens']:,} tokens",
        f"- drafter: {hp['draft_layers']} layers, block 16, trained by `dflash-zoo train --regenerate` on "
        f"{hp['n_text']} code prefixes (raw) + {hp['n_chat']} chat prompts, target-greedy responses; "
        f"{json.dumps({k: v for k, v in info['drafters'].get('main', {}).items() if k != 'history'})}",
        f"- held-out acceptance (greedy, block 16, {ev.get('prompts')} prompts x 256 tokens): "
        f"mean acceptance length {ev.get('mean_acceptance_length')}",
        f"- hardware: {info['hardware']}; seeds 0; total wall time {info['wall_seconds']:.0f}s; shipped size {size / 1e6:.1f} MB",
        "", "Held-out files:", "", *[f"- {h}" for h in meta["held_out"]], "",
    ]  # fmt: skip
    (out / "PROVENANCE.md").write_text("\n".join(lines))


def hardware(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()} CPU x{os.cpu_count()} (torch {torch.__version__})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("build/demo"))
    ap.add_argument("--out", type=Path, default=Path("dflash_zoo/demo"))
    ap.add_argument("--stage", choices=["prep", "all", "draft"], default="all")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test at toy scale.")
    ap.add_argument(
        "--ablations", action="store_true", help="Also train and evaluate the docs/ablations.md variants."
    )
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--ablation-device", default=None, help="Device for the ablation runs (default: --device)."
    )
    ap.add_argument("--scale", type=float, default=1.0, help="Multiply the drafter time budgets.")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Override one hp entry.")
    ap.add_argument("--tokenizer", type=Path, help="Reuse this tokenizer (e.g. dflash_zoo/demo/target).")
    ap.add_argument("--init", type=Path, help="Start the main drafter from this drafter directory.")
    args = ap.parse_args()
    import torch

    hp = dict(TINY if args.tiny else FULL)
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in hp:
            ap.error(f"--set {item}: unknown key (one of {', '.join(hp)})")
        try:
            hp[key] = type(hp[key])(value)
        except ValueError:
            ap.error(f"--set {item}: {key} must be {type(hp[key]).__name__}")
    for k in ("draft_s", "abl_s"):
        hp[k] *= args.scale
    if args.tiny:
        hp["regen_tokens"] = 48
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    abl_device = args.ablation_device or device
    args.work.mkdir(parents=True, exist_ok=True)
    if args.tokenizer and not (args.work / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.work / "tokenizer")
    if args.stage == "draft":
        corpus_lists(args.work)
    else:
        prep(args.work, hp, args.tiny)
    if args.stage == "prep":
        return
    args.out.mkdir(parents=True, exist_ok=True)
    data, held = write_data(args.work, hp)
    info = {"hardware": hardware(device)}
    if args.stage == "all":
        info["target"] = train_target(args.work, args.out, hp, device)
    info["target_report"] = target_report(args.work, args.out, hp, device)
    info["drafters"], env = drafters(
        args.work, args.out, hp, device, abl_device, args.ablations, data, args.init
    )
    names = list(VARIANTS) if args.ablations else []
    info["eval"] = evaluate_all(args.work, args.out, held, device, abl_device, names, env)
    info["wall_seconds"] = time.time() - T0
    results = args.work / "results.json" if args.stage == "draft" else args.out / "results.json"
    results.write_text(json.dumps({"hp": hp, **info}, indent=1, default=str))
    if args.stage == "all":
        provenance(args.out, args.work, hp, info)
    say("done")


if __name__ == "__main__":
    main()
