# axonmpi — two commands for a new machine with python3 and pip:
#   make demo   installs into .venv, then trains the char GPT with DDP on RANKS (default 4) local ranks
#   make test   installs, then runs the test suite at 1, 2, 3 and 4 ranks, and the N-D layouts at 8
#               (11-13 minutes on the 2-core development machine, whose speed varies between days: 10:44 and
#               12:43 measured; tests marked `slow` -- whose behaviour a faster test also covers --
#               wait for `make test-all`, which runs every test in the same passes and the N-D layouts at 16 too)
# (--capture=sys: pytest captures sys.stdout / sys.stderr, not file descriptor 2, so a report a rank ends the job
# on -- the watchdog's -- reaches the terminal even though the process is killed)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
NPS ?= 1 2 3 4
# the 1-rank pass runs as this many shards at once (its tests mostly wait on the jobs they launch: one
# pytest leaves the second core idle about half the time), of equal time by tests/durations-np1.tsv
# (python tests/slowest.py .test-logs --write-np1 tests/durations-np1.tsv renews it); NP1_SHARDS=1 runs it as one
NP1_SHARDS ?= 2
# the N-D layouts (tests marked nd: three or more axes through parallelize) run in their own pass at these sizes;
# make test-all adds 16 ranks (the same layouts with the data dimension doubled; every layout runs at 8)
ND_NPS ?= 8
PYTEST_ARGS ?= -q
# make test leaves out the tests marked slow (each covered faster by another test); make test-all runs them too
TEST_MARK ?= not slow
MARK_ARG = $(if $(TEST_MARK),-m "$(TEST_MARK)",)
ND_MARK_ARG = -m "nd$(if $(TEST_MARK), and ($(TEST_MARK)),)"
DEMO_ARGS ?=
RANKS ?= 4
DEMO_DIR ?= checkpoints/gpt
export PYTHONUNBUFFERED := 1
# every rank of every job compiles axonmpi's sources again when .pyc files may not be written (and pytest rewrites
# every test module again): a shell that sets PYTHONDONTWRITEBYTECODE made the suite twice as slow
unexport PYTHONDONTWRITEBYTECODE
# a new demo replaces the last demo's checkpoints; DEMO_ARGS="--resume --steps 600" continues them
DEMO_FRESH := $(if $(findstring resume,$(DEMO_ARGS)),,--overwrite)

.PHONY: install test test-all test-interop test-gpu demo bench fuzz clean help

help:
	@echo "make demo   - install into $(VENV) and run the main job (DDP char-GPT) on RANKS=$(RANKS) local ranks"
	@echo "make test   - install and run the suite under mpiexec -n N for N in $(NPS) (and -m nd at $(ND_NPS)), without the tests marked slow"
	@echo "make test-all - the same passes with every test, the slow ones included"
	@echo "make test-interop - install torch (CPU) and transformers into $(VENV), then run the tests against them"
	@echo "make test-gpu - run every @pytest.mark.gpu test in tests/ at 1..number-of-GPUs ranks (NCCL, CuPy; skipped without a GPU)"
	@echo "make bench  - run the benchmarks in bench/ beside the anchors in ../shared/anchors"
	@echo "make fuzz N=500 SEED=0 FUZZ_RANKS=4 - the composition fuzzer: N generated models x layouts against one process"

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[mpich,test]'
	@touch $@

install: $(VENV)/.installed

test: install
	@rm -rf .test-logs; mkdir -p .test-logs; set -e; for n in $(NPS); do \
	  echo "=== pytest --with-mpi on $$n rank(s) ==="; \
	  shards=1; [ $$n = 1 ] && shards=$(NP1_SHARDS); status=0; \
	  for k in $$(seq 1 $$(($$shards - 1))); do \
	    OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS:-1} \
	    $(MPIEXEC) -n 1 $(PY) -m pytest --with-mpi -p no:cacheprovider --capture=sys --shard $$k/$$shards \
	      $(MARK_ARG) $(PYTEST_ARGS) > .test-logs/np1-shard$$k.out 2>&1 & echo $$! > .test-logs/np1-shard$$k.pid; \
	  done; \
	  OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS:-1} \
	  $(MPIEXEC) -n $$n $(PY) -m pytest --with-mpi -p no:cacheprovider --capture=sys --shard 0/$$shards \
	    $(MARK_ARG) $(PYTEST_ARGS) || status=$$?; \
	  for k in $$(seq 1 $$(($$shards - 1))); do \
	    wait $$(cat .test-logs/np1-shard$$k.pid) || status=$$?; \
	    echo "=== the 1-rank pass, shard $$k of $$shards (run beside the one above) ==="; cat .test-logs/np1-shard$$k.out; \
	  done; \
	  [ $$status = 0 ] || { echo "*** the $$n-rank run failed (exit $$status); reports of the other ranks:"; \
	    for f in .test-logs/np$$n-rank*.log; do [ -f $$f ] && { echo "--- $$f"; cat $$f; }; done; \
	    exit $$status; }; \
	done; \
	for n in $(ND_NPS); do \
	  echo "=== N-D layouts: pytest -m nd --with-mpi on $$n ranks ==="; \
	  OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS:-1} \
	  $(MPIEXEC) -n $$n $(PY) -m pytest --with-mpi -p no:cacheprovider --capture=sys $(ND_MARK_ARG) $(PYTEST_ARGS) tests/test_nd_layouts.py tests/test_recipe_layouts.py tests/test_no_sync.py tests/test_sharded_state.py tests/test_fuzz.py tests/test_memory_resume.py \
	    tests/test_llama_nd.py tests/test_ported_layouts.py || { \
	    status=$$?; echo "*** the $$n-rank N-D run failed (exit $$status); reports of the other ranks:"; \
	    for f in .test-logs/np$$n-rank*.log; do [ -f $$f ] && { echo "--- $$f"; cat $$f; }; done; \
	    exit $$status; }; \
	done; $(PY) tests/slowest.py .test-logs 10; echo "=== all passes green: $(NPS) rank(s), N-D layouts at $(ND_NPS) ==="

test-all:
	$(MAKE) test TEST_MARK= ND_NPS="8 16"

INTEROP_TESTS ?= tests/test_gpt2_interop.py tests/test_gpt2_layouts.py tests/test_safetensors.py tests/test_torch_surface.py \
	tests/test_collectives_interop.py tests/test_llama_layers.py tests/test_llama_interop.py tests/test_llama.py \
	tests/test_llama_recipe.py tests/test_nanogpt_ported.py tests/test_torch_select.py tests/test_finetune.py

test-interop: install
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0 transformers
	@set -e; for n in $(NPS); do \
	  echo "=== interop tests (torch, transformers, safetensors) on $$n rank(s) ==="; \
	  OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(MPIEXEC) -n $$n $(PY) -m pytest --with-mpi -p no:cacheprovider \
	    $(PYTEST_ARGS) $(INTEROP_TESTS); \
	done

test-gpu: install
	@rm -rf .test-logs; ngpus=$$($(PY) -c "from axonmpi.backend import device_count; print(device_count())"); \
	if [ "$$ngpus" -lt 1 ]; then echo "no GPU visible to CuPy: the gpu tests skip (pip install -e '.[cuda12]')"; ngpus=1; fi; \
	set -e; echo "=== CPU checks of the GPU code: CuPy/NCCL names, the NCCL stand-in ==="; \
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(MPIEXEC) -n 1 $(PY) -m pytest --with-mpi -p no:cacheprovider \
	  $(PYTEST_ARGS) tests/test_cupy_api.py tests/test_nccl_fake.py; \
	for n in $$(seq 1 $$ngpus); do \
	  echo "=== pytest -m gpu --with-mpi on $$n rank(s) ==="; \
	  OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(MPIEXEC) -n $$n $(PY) -m pytest --with-mpi -m gpu \
	    -p no:cacheprovider $(PYTEST_ARGS) tests/ || { \
	    status=$$?; for f in .test-logs/np$$n-rank*.log; do [ -f $$f ] && { echo "--- $$f"; cat $$f; }; done; \
	    exit $$status; }; \
	done; echo "=== gpu passes green: 1..$$ngpus rank(s) ==="

demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash jobs/local.sh -n $(RANKS) examples/train_gpt.py \
	  --checkpoint-dir $(DEMO_DIR) $(DEMO_FRESH) $(DEMO_ARGS)

bench: install
	$(MPIEXEC) -n 2 $(PY) bench/collectives.py

# the composition fuzzer (tests/fuzz): N generated cases from SEED at FUZZ_RANKS ranks; a failure prints its seed and
# the smallest model and layout that still fail (rerun one: python tests/fuzz/run.py --only SEED)
N ?= 100
SEED ?= 0
FUZZ_RANKS ?= 4
fuzz: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS:-1} \
	  $(MPIEXEC) -n $(FUZZ_RANKS) $(PY) tests/fuzz/run.py --cases $(N) --seed $(SEED)

clean:
	rm -rf $(VENV) .test-logs build *.egg-info .pytest_cache
