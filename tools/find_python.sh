#!/usr/bin/env bash
# Print a Python 3.12 interpreter: python3.12 on PATH, else a pyenv-installed 3.12.
for cand in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
  if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
    echo "$cand"; exit 0
  fi
done
echo "error: Python 3.12 not found (install python3.12; jax 0.12 needs it)" >&2
exit 1
