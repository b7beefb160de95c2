# Sourced by scripts/gpu_check.sh and scripts/gpu_bench.sh (from the repository root): what a GPU
# machine without DeepSpeed needs, as wheels in .whl/.
#   prepare_gpu_wheels   here, with network: pack deepspeed, hjson and pydantic's wheels into .whl/
#   use_gpu_wheels       there: install them into /tmp/site (on PYTHONPATH) unless deepspeed imports
#   gpu_prelude "$@"     a script's start: --prepare-wheels packs them and exits, anything else installs
prepare_gpu_wheels() {
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8 hjson==3.1.0
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    ls .whl
}

use_gpu_wheels() {
    if ! python3 -c "import deepspeed, pydantic" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
}

gpu_prelude() {
    if [[ "${1:-}" == "--prepare-wheels" ]]; then
        prepare_gpu_wheels
        exit 0
    fi
    use_gpu_wheels
}
