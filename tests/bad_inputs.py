"""The table of `tests/test_bad_inputs.py`: bad inputs a new user types, one row each, across every command.

A row names the arguments (with `{placeholders}` for the files of `World`), the exit code (2 usage, 1 runtime,
3 incompatible) and words the one error line must hold. `loads=True` marks the few rows that fail only after
a model has loaded (the check needs the model); every other row must fail before any target loads.
`torch_free=True` rows are also run in a fresh interpreter that must not import torch; `unreadable=True` rows
run in a subprocess without the capabilities that let root read any file; `hub=True` rows talk to the
loopback Hub server (tests/hubserver.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    code: int
    says: tuple[str, ...]
    loads: bool = False
    torch_free: bool = False
    unreadable: bool = False
    hub: bool = False
    chatter: bool = False  # progress lines on stderr before the error are expected (a pull's plan)


def case(argv: str, code: int, *says: str, **kw: bool) -> Case:
    """A row; `argv` is split on spaces (use placeholders for anything with spaces)."""
    return Case(tuple(argv.split()), code, says, **kw)


PAIR = "-t {target} -d {draft}"
TRAIN = "train --target {target} --data {data} --out {tmp}/out"
EVAL = "eval -t {target} -d {draft} --data {data}"
BENCH = "bench -t {target} -d {draft}"

CASES: dict[str, Case] = {
    # ---- the command line itself ----------------------------------------------------------------
    "unknown-command": case("generat x", 2, "No such command 'generat'", torch_free=True),
    "unknown-global-option": case("--bogus list", 2, "No such option", "--bogus"),
    "help-of-unknown-command": case("help generate", 2, "No such command 'help'"),
    "not-utf8-argument": case("generate {not_utf8}", 2, "is not valid UTF-8"),
    # ---- generate -----------------------------------------------------------------------------------
    "generate-no-prompt": case("generate", 2, "Missing argument 'PROMPT'"),
    "generate-max-new-tokens-0": case(f"generate x {PAIR} --max-new-tokens 0", 2, "--max-new-tokens"),
    "generate-max-new-tokens-negative": case(f"generate x {PAIR} -n -5", 2, "--max-new-tokens"),
    "generate-max-new-tokens-word": case(f"generate x {PAIR} -n many", 2, "'many' is not a valid integer"),
    "generate-temperature-negative": case(f"generate x {PAIR} --temperature -1", 2, "--temperature"),
    "generate-temperature-nan": case(f"generate x {PAIR} --temperature nan", 2, "not a finite number"),
    "generate-temperature-inf": case(f"generate x {PAIR} --temperature inf", 2, "not a finite number"),
    "generate-top-p-0": case(f"generate x {PAIR} --top-p 0", 2, "--top-p"),
    "generate-top-p-above-1": case(f"generate x {PAIR} --top-p 1.5", 2, "--top-p"),
    "generate-top-p-nan": case(f"generate x {PAIR} --top-p nan", 2, "not a finite number"),
    "generate-top-k-negative": case(f"generate x {PAIR} --top-k -1", 2, "--top-k"),
    "generate-seed-past-range": case(f"generate x {PAIR} --seed 18446744073709551616", 2, "--seed"),
    "generate-block-size-1": case(f"generate x {PAIR} --block-size 1", 2, "--block-size"),
    "generate-block-size-above-trained": case(
        f"generate x {PAIR} --block-size 32",
        2,
        "block_size 32 exceeds the drafter's trained block size 8",
        loads=True,
    ),
    "generate-seed-word": case(f"generate x {PAIR} --seed abc", 2, "'abc' is not a valid integer"),
    "generate-dtype-typo": case(f"generate x {PAIR} --dtype fp8", 2, "'fp8' is not one of"),
    "generate-device-nonsense": case(f"generate x {PAIR} --device gpu0", 2, "unknown device 'gpu0'"),
    "generate-device-and-devices": case(
        f"generate x {PAIR} --device cpu --devices cuda:0,cuda:1", 2, "do not combine it with --device"
    ),
    "generate-devices-empty-item": case(f"generate x {PAIR} --devices cuda:0,,cuda:1", 2, "bad device list"),
    "generate-devices-nonsense": case(
        f"generate x {PAIR} --devices tpu:0,tpu:1", 2, "unknown device 'tpu:0'"
    ),
    "generate-registry-typo": case(
        "generate x -t qwen3-8bb", 1, "no registry entry named 'qwen3-8bb'", torch_free=True
    ),
    "generate-registry-typo-json": case(
        "generate x -t qwen3-8bb --json", 1, "no registry entry named 'qwen3-8bb'", torch_free=True
    ),
    "generate-missing-target-dir": case(
        "generate x -t ./no-such-target -d {draft}", 1, "no such directory: ./no-such-target"
    ),
    "generate-missing-draft-dir": case(
        "generate x -t {target} -d ./no-such-draft", 1, "no such directory: ./no-such-draft"
    ),
    "generate-target-is-a-file": case(
        "generate x -t {file} -d {draft}", 1, "is a file, not a model directory"
    ),
    "generate-target-dir-without-draft": case("generate x -t {target}", 1, "is a directory but no --draft"),
    "generate-target-without-model-type": case("generate x -t {nomt} -d {draft}", 1, "has no model_type"),
    "generate-target-model-type-number": case("generate x -t {mt_number} -d {draft}", 1, "has no model_type"),
    "generate-target-unknown-family": case(
        "generate x -t {gpt2} -d {draft}", 1, "no dflash-zoo adapter for model_type 'gpt2'"
    ),
    "generate-target-config-not-json": case("generate x -t {notjson} -d {draft}", 1, "is not valid JSON"),
    "generate-target-config-a-list": case("generate x -t {jsonlist} -d {draft}", 1, "is not a JSON object"),
    "generate-target-config-not-utf8": case("generate x -t {cfg_latin1} -d {draft}", 1, "is not valid UTF-8"),
    "generate-target-no-config": case("generate x -t {noconfig} -d {draft}", 1, "config"),
    "generate-target-truncated-weights": case(
        "generate x -t {trunc} -d {draft}", 1, "model.safetensors are truncated or corrupt"
    ),
    "generate-target-missing-shard": case(
        "generate x -t {missing_shard} -d {draft}", 1, "lacks weight shard"
    ),
    "generate-target-config-unreadable": case(
        "generate x -t {unreadable} -d {draft}", 1, "cannot read", "permission denied", unreadable=True
    ),
    "generate-draft-is-a-target": case(
        "generate x -t {target} -d {target}", 2, "unknown drafter architecture"
    ),
    "generate-raw-empty-prompt": case(f"generate {{empty}} {PAIR} --raw", 2, "the prompt is empty"),
    "generate-image-missing": case(
        f"generate x {PAIR} --image {{tmp}}/no-such.png", 2, "no-such.png", "does not exist"
    ),
    "generate-image-a-directory": case(f"generate x {PAIR} --image {{tmp}}", 2, "is a directory"),
    "generate-prompt-too-long": case(
        f"generate {{long_prompt}} {PAIR} --raw", 2, "the target holds 2,048 positions", loads=True
    ),
    "generate-unknown-option": case(f"generate x {PAIR} --max-tokens 5", 2, "No such option", "--max-tokens"),
    "generate-json-usage-error": case(f"generate x {PAIR} --json --top-k -1", 2, "--top-k"),
    "generate-hidden-size-mismatch": case("generate x -t {target} -d {wide_draft}", 3, "hidden", loads=True),
    # ---- chat -----------------------------------------------------------------------------------------
    "chat-registry-typo": case("chat qwen3-8bb", 1, "no registry entry named 'qwen3-8bb'"),
    "chat-path-that-does-not-exist": case("chat ./no-such-model", 1, "no such directory: ./no-such-model"),
    "chat-max-new-tokens-0": case(f"chat {PAIR} -n 0", 2, "--max-new-tokens"),
    "chat-temperature-nan": case(f"chat {PAIR} --temperature nan", 2, "not a finite number"),
    "chat-top-p-2": case(f"chat {PAIR} --top-p 2", 2, "--top-p"),
    "chat-dtype-typo": case(f"chat {PAIR} --dtype half", 2, "'half' is not one of"),
    "chat-device-nonsense": case(f"chat {PAIR} --device gpu", 2, "unknown device 'gpu'"),
    "chat-unknown-option": case(f"chat {PAIR} --system hi", 2, "No such option", "--system"),
    "chat-target-without-model-type": case("chat -t {nomt} -d {draft}", 1, "has no model_type"),
    "chat-two-models": case("chat qwen3-8b qwen3-4b", 2, "Got unexpected extra argument"),
    # ---- train ----------------------------------------------------------------------------------------
    "train-no-target": case("train --data {data} --out {tmp}/out", 2, "Missing option '--target'"),
    "train-no-data": case("train --target {target} --out {tmp}/out", 2, "Missing option '--data'"),
    "train-no-out": case("train --target {target} --data {data}", 2, "Missing option '--out'"),
    "train-lr-nan": case(f"{TRAIN} --lr nan", 2, "--lr", "not a finite number"),
    "train-lr-negative": case(f"{TRAIN} --lr -1", 2, "--lr"),
    "train-lr-zero": case(f"{TRAIN} --lr 0", 2, "--lr"),
    "train-lr-inf": case(f"{TRAIN} --lr inf", 2, "--lr"),
    "train-lr-word": case(f"{TRAIN} --lr fast", 2, "'fast' is not a valid float"),
    "train-loss-decay-gamma-nan": case(f"{TRAIN} --loss-decay-gamma nan", 2, "--loss-decay-gamma"),
    "train-loss-decay-gamma-negative": case(f"{TRAIN} --loss-decay-gamma -7", 2, "--loss-decay-gamma"),
    "train-weight-decay-nan": case(f"{TRAIN} --weight-decay nan", 2, "--weight-decay"),
    "train-weight-decay-negative": case(f"{TRAIN} --weight-decay -0.1", 2, "--weight-decay"),
    "train-warmup-ratio-2": case(f"{TRAIN} --warmup-ratio 2", 2, "--warmup-ratio"),
    "train-warmup-ratio-nan": case(f"{TRAIN} --warmup-ratio nan", 2, "not a finite number"),
    "train-epochs-inf": case(f"{TRAIN} --epochs inf", 2, "not a finite number"),
    "train-time-budget-nan": case(f"{TRAIN} --time-budget nan", 2, "not a finite number"),
    "train-cache-shard-mb-nan": case(f"{TRAIN} --cache-shard-mb nan", 2, "not a finite number"),
    "train-block-size-past-max-length": case(
        f"{TRAIN} --block-size 4096 --max-length 128", 2, "block size 4096 does not fit --max-length 128"
    ),
    "train-block-size-equal-max-length": case(
        f"{TRAIN} --block-size 64 --max-length 64", 2, "block size 64 does not fit --max-length 64"
    ),
    "train-block-size-1": case(f"{TRAIN} --block-size 1", 2, "--block-size"),
    "train-block-size-against-init": case(
        f"{TRAIN} --init {{draft}} --block-size 4",
        2,
        "--block-size 4 differs from the --init drafter's block size 8",
    ),
    "train-max-length-2": case(f"{TRAIN} --max-length 2", 2, "--max-length"),
    "train-steps-0": case(f"{TRAIN} --steps 0", 2, "--steps"),
    "train-epochs-0": case(f"{TRAIN} --epochs 0", 2, "--epochs"),
    "train-batch-size-0": case(f"{TRAIN} --batch-size 0", 2, "--batch-size"),
    "train-draft-layers-0": case(f"{TRAIN} --draft-layers 0", 2, "--draft-layers"),
    "train-anchors-0": case(f"{TRAIN} --anchors-per-seq 0", 2, "--anchors-per-seq"),
    "train-time-budget-0": case(f"{TRAIN} --time-budget 0", 2, "--time-budget"),
    "train-save-every-negative": case(f"{TRAIN} --save-every -1", 2, "--save-every"),
    "train-mask-token-negative": case(f"{TRAIN} --mask-token-id -1", 2, "--mask-token-id"),
    "train-regen-batch-0": case(f"{TRAIN} --regen-batch-size 0", 2, "--regen-batch-size"),
    "train-prompt-tokens-0": case(f"{TRAIN} --prompt-tokens 0", 2, "--prompt-tokens"),
    "train-max-new-tokens-0": case(f"{TRAIN} --max-new-tokens 0", 2, "--max-new-tokens"),
    "train-temperature-nan": case(f"{TRAIN} --temperature nan", 2, "not a finite number"),
    "train-seed-word": case(f"{TRAIN} --seed x", 2, "'x' is not a valid integer"),
    "train-dtype-typo": case(f"{TRAIN} --dtype f32", 2, "'f32' is not one of"),
    "train-device-nonsense": case(f"{TRAIN} --device gpu", 2, "unknown device 'gpu'"),
    "train-layer-ids-outside": case(f"{TRAIN} --target-layer-ids 1,99", 2, "--target-layer-ids 99 outside"),
    "train-layer-ids-words": case(f"{TRAIN} --target-layer-ids a,b", 2, "comma-separated integers"),
    "train-data-missing": case(
        "train --target {target} --data {tmp}/none.jsonl --out {tmp}/out", 2, "no such data file"
    ),
    "train-data-a-directory": case(
        "train --target {target} --data {tmp} --out {tmp}/out", 2, "is a directory"
    ),
    "train-data-empty": case(
        "train --target {target} --data {empty_data} --out {tmp}/out", 2, "holds no records"
    ),
    "train-data-bad-json": case("train --target {target} --data {bad_json_data} --out {tmp}/out", 2, ":2:"),
    "train-data-not-utf8": case(
        "train --target {target} --data {latin1_data} --out {tmp}/out", 2, "not valid UTF-8"
    ),
    "train-data-wrong-keys": case(
        "train --target {target} --data {wrong_keys_data} --out {tmp}/out", 2, ":1:"
    ),
    "train-out-is-a-file": case("train --target {target} --data {data} --out {file}", 2, "is a file"),
    "train-out-foreign": case(
        "train --target {target} --data {data} --out {foreign_out}", 2, "was not written by dflash-zoo"
    ),
    "train-out-demo-draft": case(
        "train --target {target} --data {data} --out {demo_draft}", 2, "installed dflash-zoo package"
    ),
    "train-out-demo-draft-overwrite": case(
        "train --target {target} --data {data} --out {demo_draft} --overwrite",
        2,
        "installed dflash-zoo package",
    ),
    "train-out-holds-data": case(
        "train --target {target} --data {data_in_out}/data.jsonl --out {data_in_out} --overwrite",
        2,
        "it holds the --data input",
    ),
    "train-fresh-beside-kept-checkpoints": case(
        "train --target {target} --data {data} --out {kept}", 2, "holds the checkpoints of an earlier run"
    ),
    "train-checkpoint-sibling-foreign": case(
        "train --target {target} --data {data} --out {mine} --save-every 5 --init {mine}-checkpoint",
        2,
        "holds files dflash-zoo did not write",
    ),
    "train-resume-nothing": case(f"{TRAIN} --resume", 1, "nothing to resume"),
    "train-init-missing": case(
        f"{TRAIN} --init ./no-such-drafter", 1, "no such directory: ./no-such-drafter"
    ),
    "train-target-missing": case(
        "train --target ./no-such-target --data {data} --out {tmp}/out", 1, "no such directory"
    ),
    "train-target-without-model-type": case(
        "train --target {nomt} --data {data} --out {tmp}/out", 1, "has no model_type"
    ),
    "train-target-truncated": case(
        "train --target {trunc} --data {data} --out {tmp}/out", 1, "truncated or corrupt"
    ),
    "train-target-config-unreadable": case(
        "train --target {unreadable} --data {data} --out {tmp}/out", 1, "cannot read", unreadable=True
    ),
    "train-json-usage-error": case(f"{TRAIN} --json --lr nan", 2, "--lr"),
    # ---- eval -----------------------------------------------------------------------------------------
    "eval-no-data": case(f"eval {PAIR}", 2, "Missing option '--data'"),
    "eval-data-missing": case(f"eval {PAIR} --data {{tmp}}/none.jsonl", 2, "no such data file"),
    "eval-data-not-utf8": case(f"eval {PAIR} --data {{latin1_data}}", 2, "not valid UTF-8"),
    "eval-data-empty": case(f"eval {PAIR} --data {{empty_data}}", 2, "holds no records"),
    "eval-empty-prompt-line": case(
        f"eval {PAIR} --data {{empty_prompt_data}} --raw",
        2,
        "empty-prompt.jsonl:2: the prompt is empty",
        loads=True,
        chatter=True,
    ),
    "eval-limit-0": case(f"{EVAL} --limit 0", 2, "--limit"),
    "eval-top-p-nan": case(f"{EVAL} --top-p nan", 2, "not a finite number"),
    "eval-top-k-negative": case(f"{EVAL} --top-k -3", 2, "--top-k"),
    "eval-temperature-nan": case(f"{EVAL} --temperature nan", 2, "not a finite number"),
    "eval-block-size-1": case(f"{EVAL} --block-size 1", 2, "--block-size"),
    "eval-block-size-above-trained": case(
        f"{EVAL} --block-size 64", 2, "exceeds the drafter's trained block size", loads=True, chatter=True
    ),
    "eval-prompt-tokens-0": case(f"{EVAL} --prompt-tokens 0", 2, "--prompt-tokens"),
    "eval-max-new-tokens-0": case(f"{EVAL} -n 0", 2, "--max-new-tokens"),
    "eval-registry-typo": case("eval -t qwen3-8bb --data {data}", 1, "no registry entry named 'qwen3-8bb'"),
    "eval-dtype-typo": case(f"{EVAL} --dtype bfloat", 2, "'bfloat' is not one of"),
    "eval-device-nonsense": case(f"{EVAL} --device nonsense", 2, "unknown device 'nonsense'"),
    "eval-target-without-model-type": case("eval -t {nomt} -d {draft} --data {data}", 1, "has no model_type"),
    "eval-json-error": case("eval -t qwen3-8bb --data {data} --json", 1, "no registry entry"),
    # ---- bench ----------------------------------------------------------------------------------------
    "bench-prompt-tokens-past-positions": case(
        "bench --prompt-tokens 100000", 2, "does not fit the target's 2,048 positions"
    ),
    "bench-prompt-tokens-past-positions-local": case(
        f"{BENCH} --prompt-tokens 5000", 2, "does not fit the target's 2,048 positions"
    ),
    "bench-prompt-tokens-0": case("bench --prompt-tokens 0", 2, "--prompt-tokens"),
    "bench-unknown-shape": case("bench --shape qwen9-1t", 2, "unknown shape 'qwen9-1t'"),
    "bench-shape-and-model": case("bench --shape qwen3-8b -t {target}", 2, "--shape builds a random target"),
    "bench-shape-and-prompts": case("bench --shape qwen3-8b --prompts {data}", 2, "--shape has no tokenizer"),
    "bench-devices-and-device": case(
        "bench --devices cuda:0,cuda:1 --device cpu", 2, "do not combine it with --device"
    ),
    "bench-max-new-tokens-1": case("bench -n 1", 2, "--max-new-tokens"),
    "bench-repeats-0": case("bench --repeats 0", 2, "--repeats"),
    "bench-warmup-negative": case("bench --warmup -1", 2, "--warmup"),
    "bench-what-if-below-1": case("bench --what-if-acceptance 0.5", 2, "--what-if-acceptance"),
    "bench-what-if-nan": case("bench --what-if-acceptance nan", 2, "not a finite number"),
    "bench-temperature-nan": case("bench --temperature nan", 2, "not a finite number"),
    "bench-top-p-nan": case("bench --top-p nan", 2, "not a finite number"),
    "bench-path-unknown": case("bench --path turbo", 2, "'turbo' is not one of"),
    "bench-dtype-typo": case("bench --dtype fp64", 2, "'fp64' is not one of"),
    "bench-device-nonsense": case("bench --device gpu", 2, "unknown device 'gpu'"),
    "bench-out-exists": case("bench --out {file}", 2, "exists; bench does not overwrite a file"),
    "bench-prompts-missing": case("bench --prompts {tmp}/none.jsonl", 2, "none.jsonl"),
    "bench-limit-0": case("bench --limit 0", 2, "--limit"),
    "bench-devices-not-here": case("bench --shape tiny-qwen3 --devices cuda:0,cuda:1", 2, "is not visible"),
    "bench-what-if-past-block": case(
        "bench --what-if-acceptance 9 --block-size 8", 2, "exceeds --block-size 8"
    ),
    "bench-registry-typo": case("bench qwen3-8bb", 1, "no registry entry named 'qwen3-8bb'"),
    "bench-target-without-model-type": case("bench -t {nomt} -d {draft}", 1, "has no model_type"),
    "bench-json-error": case("bench --shape qwen9-1t --json", 2, "unknown shape"),
    # ---- serve ----------------------------------------------------------------------------------------
    "serve-no-engine": case("serve qwen3-8b --dry-run", 2, "Missing option '--engine'"),
    "serve-unknown-engine": case("serve qwen3-8b --engine tgi --dry-run", 2, "'tgi' is not one of"),
    "serve-tp-0": case("serve qwen3-8b --engine vllm --tp 0 --dry-run", 2, "--tp"),
    "serve-tp-65": case("serve qwen3-8b --engine vllm --tp 65 --dry-run", 2, "--tp"),
    "serve-tp-not-dividing-heads": case(
        "serve tiny-test --engine vllm --tp 3 --dry-run",
        2,
        "--tp 3 does not split",
        "32 attention heads",
        hub=True,
    ),
    "serve-tp-not-dividing-kv-heads": case(
        "serve tiny-test --engine sglang --tp 4 --dry-run", 2, "--tp 4 does not split", "6 KV heads", hub=True
    ),
    "serve-tp-local-target": case(
        "serve z-lab/Qwen3-8B-DFlash-b16 --engine vllm --target {target} --tp 3 --block-size 8 --dry-run",
        2,
        "--tp 3 does not split",
    ),
    "serve-block-size-above-trained": case(
        "serve qwen3-8b --engine vllm --block-size 32 --dry-run",
        2,
        "--block-size 32 exceeds the block size 16",
    ),
    "serve-block-size-1": case("serve qwen3-8b --engine vllm --block-size 1 --dry-run", 2, "--block-size"),
    "serve-port-0": case("serve qwen3-8b --engine vllm --port 0 --dry-run", 2, "--port"),
    "serve-port-too-big": case("serve qwen3-8b --engine vllm --port 70000 --dry-run", 2, "--port"),
    "serve-registry-typo": case(
        "serve qwen3-8bb --engine vllm --dry-run", 1, "no registry entry named 'qwen3-8bb'", torch_free=True
    ),
    "serve-missing-local-drafter": case(
        "serve ./no-such-drafter --engine vllm --target {target} --dry-run", 1, "no such directory: ./no-such"
    ),
    "serve-repo-without-target": case("serve org/drafter --engine vllm --dry-run", 2, "pass --target"),
    "serve-misspelt-option": case("serve qwen3-8b --engine vllm --dryrun", 2, "No such option '--dryrun'"),
    "serve-json-without-dry-run": case("serve qwen3-8b --engine vllm --json", 2, "add --dry-run"),
    "serve-unsupported-entry": case(
        "serve tiny-unsupported --engine vllm --dry-run", 1, "unsupported here", hub=True
    ),
    "serve-json-error": case("serve qwen3-8b --engine vllm --tp 0 --dry-run --json", 2, "--tp"),
    "serve-marked-entry": case(
        "serve alpamayo-r1-10b --engine sglang --dry-run", 1, "marked unsupported here", torch_free=True
    ),
    # ---- pull -----------------------------------------------------------------------------------------
    "pull-no-id": case("pull", 2, "Missing argument 'MODEL_ID'"),
    "pull-registry-typo": case("pull qwen3-8bb", 1, "no registry entry named 'qwen3-8bb'", torch_free=True),
    # a published drafter dflash-zoo lists but cannot run: refused with its reason, not "no registry entry"
    "pull-marked-entry": case(
        "pull alpamayo-1.5-10b --json", 1, "marked unsupported here", "mask embedding", torch_free=True
    ),
    "pull-unsupported-entry": case("pull tiny-unsupported --dry-run", 1, "never runs here", hub=True),
    "pull-force-offline-by-environment": case("pull qwen3-8b --verify --force", 2, "unset HF_HUB_OFFLINE"),
    "pull-malformed-repo-id": case("pull org/a--b", 2, "'org/a--b' is not a valid Hub repo id", hub=True),
    "generate-marked-entry": case("generate x -t alpamayo-1.5-10b", 1, "marked unsupported here"),
    "chat-marked-entry": case("chat glm-5.3-flash", 1, "marked unsupported here", "glm5_next"),
    "bench-marked-entry": case("bench alpamayo-r1-10b", 1, "marked unsupported here"),
    "pull-repo-with-target": case("pull org/name --with-target", 2, "--with-target needs a registry id"),
    "pull-force-offline": case(
        "pull tiny-test --force --offline", 2, "needs the network", hub=True, chatter=True
    ),
    "pull-offline-not-cached": case("pull qwen3-8b --offline", 1, "not in the local cache", torch_free=True),
    "pull-no-such-repo": case(
        "pull zoo-test/no-such-repo", 1, "no such repo: zoo-test/no-such-repo", hub=True
    ),
    "pull-no-such-revision": case("pull tiny-test --revision v9", 1, "has no revision 'v9'", hub=True),
    "pull-gated": case("pull zoo-test/gated-draft", 1, "is gated", hub=True),
    "pull-hub-down": case("pull tiny-test", 1, "answered HTTP 503", hub=True),
    "pull-corrupt": case("pull tiny-test", 1, "failed verification", hub=True, chatter=True),
    "pull-json-error": case("pull qwen3-8bb --json", 1, "no registry entry"),
    "pull-unknown-option": case("pull qwen3-8b --all", 2, "No such option", "--all"),
    "pull-path-like": case("pull ./some/dir/x", 1, "./some/dir/x"),
    # ---- rm -------------------------------------------------------------------------------------------
    "rm-no-id": case("rm", 2, "Missing argument 'MODEL_IDS...'"),
    "rm-registry-typo": case("rm qwen3-8bb --yes", 1, "no registry entry named 'qwen3-8bb'", torch_free=True),
    "rm-repo-with-target": case("rm org/name --with-target", 2, "--with-target needs a registry id"),
    "rm-without-yes-not-interactive": case("rm tiny-test", 2, "pass --yes", hub=True, chatter=True),
    "rm-json-without-yes": case("rm tiny-test --json", 2, "pass --yes", hub=True, chatter=True),
    "rm-json-error": case("rm qwen3-8bb --json", 1, "no registry entry"),
    # ---- list / info ----------------------------------------------------------------------------------
    "list-json-and-quiet": case("list --json -q", 2, "--json and -q cannot be combined", torch_free=True),
    "list-two-patterns": case("list qwen llama", 2, "Got unexpected extra argument"),
    "list-unknown-option": case("list --all", 2, "No such option", "--all"),
    "list-registry-file-missing": case("list", 1, "registry", torch_free=True),
    "list-json-registry-broken": case("list --json", 1, "registry"),
    "info-no-name": case("info", 2, "Missing argument 'NAME'"),
    "info-typo": case("info qwen3-8bb", 1, "no registry entry named 'qwen3-8bb'", torch_free=True),
    "info-typo-json": case("info qwen3-8bb --json", 1, "no registry entry named 'qwen3-8bb'"),
    "info-two-names": case("info qwen3-8b qwen3-4b", 2, "Got unexpected extra argument"),
    "info-empty-name": case("info {empty}", 1, "no registry entry"),
    # ---- check ----------------------------------------------------------------------------------------
    "check-no-target": case("check", 2, "Missing option", "--target"),
    "check-missing-local-target": case(
        "check --target ./no-such-target --offline", 1, "no such directory: ./no-such-target", torch_free=True
    ),
    "check-registry-typo": case(
        "check --target qwen3-8bb", 1, "no registry entry named 'qwen3-8bb'", torch_free=True
    ),
    "check-target-without-model-type": case(
        "check --target {nomt} --draft {draft}", 1, "lacks model_type", torch_free=True
    ),
    "check-target-without-model-type-json": case(
        "check --target {nomt} --draft {draft} --json", 1, "lacks model_type"
    ),
    "check-target-config-not-json": case("check --target {notjson} --draft {draft}", 1, "is not valid JSON"),
    "check-target-config-unreadable": case(
        "check --target {unreadable} --draft {draft}", 1, "cannot read", "permission denied", unreadable=True
    ),
    "check-target-dir-without-config": case(
        "check --target {noconfig} --draft {draft}", 1, "without config.json"
    ),
    "check-config-missing": case("check --target qwen3-8b --config {tmp}/none.json", 2, "none.json"),
    "check-config-not-json": case(
        "check --target qwen3-8b --config {notjson}/config.json", 1, "is not valid JSON"
    ),
    "check-config-a-list": case(
        "check --target qwen3-8b --config {jsonlist}/config.json", 1, "is not a JSON object"
    ),
    "check-config-empty": case("check --target qwen3-8b --config {empty_file}", 1, "is not valid JSON"),
    "check-draft-config-not-json": case(
        "check --target {target} --draft-config {notjson}/config.json", 1, "JSON"
    ),
    "check-drafter-as-target": case("check --target z-lab/Qwen3-8B-DFlash-b16", 2, "is a drafter"),
    "check-draft-typo": case(
        "check --target {target} --draft qwen3-8bb", 1, "no registry entry named 'qwen3-8bb'"
    ),
    "check-unknown-option": case("check --target qwen3-8b --verbose", 2, "No such option", "--verbose"),
    # ---- env ------------------------------------------------------------------------------------------
    "env-extra-argument": case("env now", 2, "Got unexpected extra argument"),
    "env-unknown-option": case("env --all", 2, "No such option", "--all"),
    # ---- convert --------------------------------------------------------------------------------------
    "convert-no-layout": case("convert {draft} {tmp}/out", 2, "Missing option '--to'"),
    "convert-unknown-layout": case("convert {draft} {tmp}/out --to gguf", 2, "'gguf' is not one of"),
    "convert-missing-source": case(
        "convert ./no-such-drafter {tmp}/out --to speculators", 1, "no-such-drafter"
    ),
    "convert-out-foreign": case("convert {draft} {foreign_out} --to zlab", 2, "not written by dflash-zoo"),
    "convert-out-demo": case(
        "convert {draft} {demo_draft} --to zlab --overwrite", 2, "installed dflash-zoo package"
    ),
}
