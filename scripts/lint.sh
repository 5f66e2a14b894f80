#!/usr/bin/env bash
# Lints the checkout: `ruff check` over the Python (rules in pyproject.toml) and
# clang-format (the repo's .clang-format) over every tracked C++/CUDA file, as a
# dry run: nothing is rewritten. Installs the pinned ruff and clang-format into
# this Python when missing or at another version. Exits non-zero on any finding,
# after running both, so one run shows everything.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}

RUFF=0.17.6
CLANG_FORMAT=23.1.5

# One interpreter start for both versions: the script is meant to take seconds.
read -r have_ruff have_clang_format < <("$py" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "none"

print(installed("ruff"), installed("clang-format"))
EOF
)
wanted=()
[ "$have_ruff" = "$RUFF" ] || wanted+=("ruff==$RUFF")
[ "$have_clang_format" = "$CLANG_FORMAT" ] || wanted+=("clang-format==$CLANG_FORMAT")
if ((${#wanted[@]})); then
  echo "== installing ${wanted[*]}"
  "$py" -m pip install --quiet --root-user-action=ignore "${wanted[@]}"
fi

status=0

echo "== ruff check"
"$py" -m ruff check . || status=1

# Only the files git tracks (not build trees or scratch files); a file deleted
# in the working tree but still in the index is not there to check.
files=()
while IFS= read -r -d '' f; do
  [ -e "$f" ] && files+=("$f")
done < <(git ls-files -z -- '*.cpp' '*.hpp' '*.cu' '*.cuh')
echo "== clang-format ${#files[@]} files"
if ((${#files[@]})); then
  # The wheel's own binary, through its entry point: a clang-format on PATH
  # may be another version, which formats differently.
  "$py" -c 'import clang_format; clang_format.clang_format()' --style=file --dry-run --Werror "${files[@]}" || status=1
fi

if ((status)); then
  echo "lint: findings above"
else
  echo "lint: clean"
fi
exit "$status"
