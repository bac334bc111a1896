#!/usr/bin/env bash
# Mutation testing: plants each bug of tests/mutation/mutants.txt in turn, rebuilds the test binary
# incrementally, runs the mutant's test subset, and records whether a test failed (killed) or all
# passed (survived). Not part of CI; docs/testing.md has the last run's results.
#
#   tests/mutation/run.sh                       # every mutant, build dir ./build
#   tests/mutation/run.sh sign-of-zero ...      # only the named mutants
#   BUILD=/path/build TIMEOUT=900 tests/mutation/run.sh
#   tests/mutation/run.sh --list                # names, files and test subsets
#
# Each source file is copied aside before it is changed and put back (byte for byte) after its
# mutant, also on Ctrl-C or an error; the script refuses to start on a file with uncommitted
# changes, so nothing of yours can be overwritten. A run ends with a clean rebuild of the
# unchanged sources. Results go to $BUILD/mutation/results.tsv (name, result, seconds) and each
# mutant's test output to $BUILD/mutation/<name>.log. Kernels of the mutants are cached apart from
# the test suite's ($BUILD/mutation/kernel-cache).
set -uo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
list=$root/tests/mutation/mutants.txt
build=${BUILD:-$root/build}
timeout_s=${TIMEOUT:-1200}
jobs=${JOBS:-2}
out=$build/mutation

# Prints one mutant per line: name<TAB>file<TAB>from<TAB>to<TAB>tests<TAB>env
parse() {
  awk '
    function flush() { if (name != "") print name "\t" file "\t" from "\t" to "\t" tests "\t" env; name = file = from = to = tests = env = "" }
    /^#/ || /^[[:space:]]*$/ { next }
    {
      key = $1; value = $0; sub(/^[a-z]+ /, "", value); sub(/^ */, "", value)
      if (key == "name") { flush(); name = value }
      else if (key == "file") file = value
      else if (key == "from") from = value
      else if (key == "to") to = value
      else if (key == "tests") tests = value
      else if (key == "env") env = value
    }
    END { flush() }' "$list"
}

if [[ ${1:-} == --list ]]; then
  parse | awk -F'\t' '{ printf "%-32s %-24s %s\n", $1, $2, $5 }'
  exit 0
fi

[[ -x $build/tests/kiln_tests ]] || { echo "no test binary at $build/tests/kiln_tests: build first" >&2; exit 2; }
mkdir -p "$out"
export KILN_CACHE_DIR=$out/kernel-cache

# Replaces the one occurrence of $2 in file $1 by $3; fails when it occurs zero or several times.
substitute() {
  python3 - "$@" <<'EOF'
import sys
path, old, new = sys.argv[1:4]
text = open(path, encoding="utf-8").read()
count = text.count(old)
if count != 1:
    sys.exit(f"{path}: the snippet occurs {count} times, not once: {old!r}")
open(path, "w", encoding="utf-8").write(text.replace(old, new))
EOF
}

backup=""
target=""
restore() {
  if [[ -n $backup && -f $backup ]]; then
    # Not cp -p: a fresh mtime, so make rebuilds what was compiled from the mutant.
    cp "$backup" "$target" && rm -f "$backup"
  fi
  backup=""
}
trap 'restore; echo "interrupted: $target restored" >&2; exit 130' INT TERM
trap restore EXIT

rebuild() { cmake --build "$build" --target kiln_tests -j "$jobs" > "$1" 2>&1; }

# Whether the build in log $1 compiled something after the change to $2; if not (make judged
# the objects newer: file times within one clock tick), touches $2 and builds again.
compiled() {
  grep -q 'Building CXX' "$1" && return 0
  sleep 1 && touch "$2" && rebuild "$1.again" && grep -q 'Building CXX' "$1.again"
}

selected=("$@")
killed=0 survived=0 invalid=0
results=$out/results.tsv
: > "$results"
while IFS=$'\t' read -r name file from to tests env; do
  if [[ ${#selected[@]} -gt 0 && ! " ${selected[*]} " == *" $name "* ]]; then continue; fi
  target=$root/$file
  if ! git -C "$root" diff --quiet HEAD -- "$file"; then
    echo "$file has uncommitted changes; commit or stash them first" >&2
    exit 2
  fi
  backup=$(mktemp "$out/$(basename "$file").orig.XXXXXX")
  cp -p "$target" "$backup"
  start=$(date +%s)
  log=$out/$name.log
  if ! substitute "$target" "$from" "$to" 2> "$log"; then
    result=invalid
  elif ! rebuild "$log.build" || ! compiled "$log.build" "$target"; then
    result=invalid  # a mutant that does not compile says nothing about the tests
  else
    # shellcheck disable=SC2086  # env is a list of VAR=value words
    env $env timeout "$timeout_s" "$build/tests/kiln_tests" "$tests" > "$log" 2>&1
    rc=$?
    if [[ $rc -eq 0 ]]; then result=survived
    elif [[ $rc -eq 124 ]]; then result=killed-timeout
    else result=killed
    fi
  fi
  restore
  seconds=$(( $(date +%s) - start ))
  case $result in
    killed*) killed=$((killed + 1)) ;;
    survived) survived=$((survived + 1)) ;;
    *) invalid=$((invalid + 1)) ;;
  esac
  failed=$(grep -E '^test cases:' "$log" | tail -1 | tr -s ' ')
  printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$seconds" "$failed" | tee -a "$results"
done < <(parse)

echo "rebuilding the unchanged sources" >&2
rebuild "$out/final-build.log" || { echo "the final rebuild failed: see $out/final-build.log" >&2; exit 2; }
total=$((killed + survived))
if [[ $total -gt 0 ]]; then
  echo "killed $killed of $total mutants ($((100 * killed / total))%), $survived survived, $invalid did not build"
fi
[[ $survived -eq 0 && $invalid -eq 0 ]]
