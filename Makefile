# Thin wrapper: environment set-up plus one line per user verb. All logic lives in `python -m pipeline`.
SHELL := /bin/bash
VENV := .venv
# The environment remembers its device: after `make setup DEVICE=gpu`, every plain target uses that environment as it
# is. Switching is explicit (`make setup DEVICE=cpu`) and says what it replaces.
INSTALLED_DEVICE := $(patsubst $(VENV)/.installed-%,%,$(firstword $(wildcard $(VENV)/.installed-*)))
DEVICE ?= $(or $(INSTALLED_DEVICE),cpu)
CONFIG ?= configs/tiny.yaml
# ARGS reaches the verbs through the environment, as one argument (--args "$ARGS"): the shell never splits, globs
# or brace-expands it, so a value with spaces (gateway.split={a: 90, b: 10}) arrives whole; the CLI splits it
# into words as a shell would and joins back the pieces of a value (pipeline/runner/cli.py)
ARGS ?=
export ARGS
RESUME ?=
DRY_RUN ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(DEVICE)
export PYTHONPATH := $(CURDIR)
export PPNLP_HOME ?= $(CURDIR)/runs/.paddlenlp

RUN_ID ?=
METRIC ?=
EXPERIMENT ?=
MODEL ?=
FILTER ?=
REAP ?=
SWEEP ?=
PARALLEL ?=
DATA ?=
ALIAS ?=
FORCE ?=
# `make test` runs this many pytest-xdist workers: most tests wait on processes, servers and I/O part of the time
TEST_WORKERS ?= 2

.PHONY: setup doctor data tokenizer train finetune evaluate promote export serve stop smoke reload generate all all-chat compare sweep bench plan test test-fast test-packages test-gpu-setup runs mlflow-ui mlflow-server mlflow-stop object-store object-store-stop gateway gateway-stop gateway-key gateway-usage visualdl visualdl-stop clean
setup: $(STAMP)

# One environment from exact pins (requirements/lock.txt, verified to install and import together) plus the Paddle
# build for DEVICE. --no-deps: the lock is complete, and paddle-serving-* declare pins that cannot install on 3.11.
$(STAMP): requirements/lock.txt requirements/paddle-$(DEVICE).txt $(if $(filter gpu,$(DEVICE)),requirements/cuda-runtime.txt)
	test -x $(PY) || python3 -m venv $(VENV)
	$(if $(filter-out $(DEVICE),$(INSTALLED_DEVICE)),@echo "switching $(VENV) from DEVICE=$(INSTALLED_DEVICE) to DEVICE=$(DEVICE): $$(head -1 requirements/paddle-$(INSTALLED_DEVICE).txt) is replaced by $$(head -1 requirements/paddle-$(DEVICE).txt)" && $(VENV)/bin/pip uninstall --disable-pip-version-check -y -q paddlepaddle paddlepaddle-gpu)
	$(VENV)/bin/pip install --disable-pip-version-check -q --no-deps -r requirements/lock.txt -r requirements/paddle-$(DEVICE).txt
	rm -f $(VENV)/.installed-*
	touch $@

# Prepare the corpus as token shards (reused by every run with the same corpus and settings; train runs it too).
data: $(STAMP)
	$(PY) -m pipeline data --config $(CONFIG) --args "$$ARGS"

# A byte-level BPE learned from the corpus (tokenizer.vocab_size), for tokenizer.path: make tokenizer [OUTPUT=dir]
tokenizer: $(STAMP)
	$(PY) -m pipeline tokenizer --config $(CONFIG) $(if $(OUTPUT),--output $(OUTPUT)) --args "$$ARGS"

train: $(STAMP)
	$(PY) -m pipeline train --config $(CONFIG) $(if $(RESUME),--resume $(RESUME)) $(if $(DRY_RUN),--dry-run) --args "$$ARGS"

# Supervised fine-tuning (docs/finetune.md): make finetune [MODEL=<run id|checkpoint dir|models:/...>] [DATA=<file.jsonl>]
# (default: full fine-tuning on the built-in review task, from the best run of tiny-zh-llama: configs/tiny-chat.yaml;
# finetune.method=lora for LoRA); RESUME=<run> continues one.
FINETUNE_CONFIG := $(if $(filter command line environment,$(origin CONFIG)),$(CONFIG),configs/tiny-chat.yaml)
finetune: $(STAMP)
	$(PY) -m pipeline finetune --config $(FINETUNE_CONFIG) $(if $(MODEL),--model $(MODEL)) $(if $(DATA),--data $(DATA)) $(if $(RESUME),--resume $(RESUME)) $(if $(DRY_RUN),--dry-run) --args "$$ARGS"

export: $(STAMP)
	$(PY) -m pipeline export --config $(CONFIG) $(if $(RUN_ID),--run-id $(RUN_ID)) $(if $(METRIC),--metric $(METRIC)) $(if $(EXPERIMENT),--experiment $(EXPERIMENT)) --args "$$ARGS"

serve: $(STAMP)
	$(PY) -m pipeline serve --config $(CONFIG) $(if $(MODEL),--model $(MODEL)) --args "$$ARGS"

stop: $(STAMP)
	$(PY) -m pipeline stop --config $(CONFIG) --args "$$ARGS"

smoke: $(STAMP)
	$(PY) -m pipeline smoke --config $(CONFIG) --args "$$ARGS"

# A server started with MODEL=models:/<name>@<alias> checks the alias now (it also does every serving.follow_interval_s).
reload: $(STAMP)
	$(PY) -m pipeline reload --config $(CONFIG) --args "$$ARGS"

# The main job on the embedded defaults: train -> export -> serve -> smoke -> stop (stop runs even if smoke fails).
all: $(STAMP)
	$(MAKE) train
	$(MAKE) export
	$(MAKE) serve
	$(MAKE) smoke; rc=$$?; $(MAKE) stop; exit $$rc

# Fine-tuning shown end to end (docs/finetune.md): the review task from `make all`'s model -> export of that run
# (RUN_ID=latest: the experiment's newest finished run) -> serve -> smoke (the held-out reviews through
# /v1/chat/completions, alone and in a conversation) -> stop. Separate from `make all` (time: README).
all-chat: $(STAMP)
	$(MAKE) finetune
	$(MAKE) export CONFIG=configs/tiny-chat.yaml RUN_ID=latest
	$(MAKE) serve CONFIG=configs/tiny-chat.yaml
	$(MAKE) smoke CONFIG=configs/tiny-chat.yaml; rc=$$?; $(MAKE) stop CONFIG=configs/tiny-chat.yaml; exit $$rc

# make compare [EXPERIMENT=...] [METRIC=...] [FILTER="..."] [OUTPUT=<dir>, default reports/compare/<experiment>]
compare: $(STAMP)
	$(PY) -m pipeline compare --config $(CONFIG) $(if $(EXPERIMENT),--experiment $(EXPERIMENT)) $(if $(METRIC),--metric $(METRIC)) $(if $(FILTER),--filter "$(FILTER)") $(if $(OUTPUT),--out "$(OUTPUT)")

# A grid of overrides, N at a time, then compared: make sweep ARGS="training.learning_rate=1e-3,3e-3 model.num_layers=2,4"
# SWEEP=<id> continues an interrupted sweep (finished runs are not retrained).
sweep: $(STAMP)
	$(PY) -m pipeline sweep --config $(CONFIG) $(if $(SWEEP),--id $(SWEEP)) $(if $(PARALLEL),--parallel $(PARALLEL)) --args "$$ARGS"

# RUNNING runs of the experiment, alive / dead / stale; REAP=1 marks the dead and stale ones FAILED.
runs: $(STAMP)
	$(PY) -m pipeline runs --config $(CONFIG) $(if $(EXPERIMENT),--experiment $(EXPERIMENT)) $(if $(REAP),--reap)

# Memory and step-time estimates of every layout of CONFIG on a cluster: make plan CONFIG=... ARGS="cluster.gpus=512"
plan: $(STAMP)
	$(PY) -m pipeline plan --config $(CONFIG) --args "$$ARGS"

# Batch generation over a table, resumable: make generate MODEL=models:/<name>@champion INPUT=prompts.jsonl OUTPUT=out.jsonl
INPUT ?=
OUTPUT ?=
ENGINE ?= local
generate: $(STAMP)
	$(PY) -m pipeline generate --config $(CONFIG) $(if $(MODEL),--model $(MODEL)) --input "$(INPUT)" --output "$(OUTPUT)" --engine $(ENGINE) --args "$$ARGS"

# A registered version on a fixed held-out set (the source run's validation split, or DATA=<corpus>) and prompt set.
evaluate: $(STAMP)
	$(PY) -m pipeline evaluate --config $(CONFIG) $(if $(MODEL),--model $(MODEL)) $(if $(DATA),--data $(DATA)) --args "$$ARGS"

# Move ALIAS (champion) to MODEL=models:/<name>/<version> if its evaluation is at least as good (FORCE=1: anyway).
promote: $(STAMP)
	$(PY) -m pipeline promote --config $(CONFIG) $(if $(MODEL),--model $(MODEL)) $(if $(ALIAS),--alias $(ALIAS)) $(if $(METRIC),--metric $(METRIC)) $(if $(FORCE),--force) --args "$$ARGS"

# What this machine can run (Paddle's build, CUDA libraries, driver, GPUs, the config's layout); exit 1 on a problem.
doctor: $(STAMP)
	$(PY) -m pipeline doctor --config $(CONFIG) --args "$$ARGS"

bench: $(STAMP)
	$(PY) -m bench $(if $(FULL),--full) $(if $(PEERS),--peers $(PEERS)) $(if $(MODEL),--export $(MODEL)) $(ARGS)

mlflow-server: $(STAMP)
	$(PY) -m pipeline mlflow-server

mlflow-stop: $(STAMP)
	$(PY) -m pipeline mlflow-stop

# VisualDL's dashboard (docs/monitoring.md) over a run's logs (RUN=<run dir or name>) or an experiment's runs
# (RUN=<experiment>); default the newest run. On visualdl.host:visualdl.port (127.0.0.1:18040).
RUN ?=
visualdl: $(STAMP)
	$(PY) -m pipeline visualdl --config $(CONFIG) $(if $(RUN),--run $(RUN)) --args "$$ARGS"

visualdl-stop: $(STAMP)
	$(PY) -m pipeline visualdl-stop --config $(CONFIG) --args "$$ARGS"

# A local S3 endpoint (SeaweedFS from .venv) for storage.uri; credentials in runs/object-store/credentials.env.
object-store: $(STAMP)
	$(PY) -m pipeline object-store

object-store-stop: $(STAMP)
	$(PY) -m pipeline object-store-stop

# The API gateway (docs/gateway.md): nginx in front of the replicas (gateway.backends), keys, limits, usage, split.
NAME ?=
RPM ?=
TPM ?=
REVOKE ?=
gateway: $(STAMP)
	$(PY) -m pipeline gateway --config $(CONFIG) --args "$$ARGS"

gateway-stop: $(STAMP)
	$(PY) -m pipeline gateway-stop --config $(CONFIG) --args "$$ARGS"

gateway-key: $(STAMP)
	$(PY) -m pipeline gateway-key --config $(CONFIG) $(if $(NAME),--name $(NAME)) $(if $(RPM),--rpm $(RPM)) $(if $(TPM),--tpm $(TPM)) $(if $(REVOKE),--revoke $(REVOKE)) --args "$$ARGS"

gateway-usage: $(STAMP)
	$(PY) -m pipeline gateway-usage --config $(CONFIG) --args "$$ARGS"

# The Debian packages the suite uses (nginx + njs, Chromium): installed when this machine can, else the command to run
test-packages:
	@tests/system-packages.sh

test: $(STAMP) test-packages
	$(PY) -m pytest -n $(TEST_WORKERS) --durations=30 tests/unit tests/integration

# Opt-in: builds the GPU environment (make setup DEVICE=gpu, ~3 GB) in a temporary venv and checks that Paddle finds
# every CUDA library inside it and that the doctor says so; needs no GPU.
test-gpu-setup: $(STAMP)
	$(PY) -m pytest -s tests/gpu

# The unit layer only (no training, no servers): under a minute.
test-fast: $(STAMP) test-packages
	$(PY) -m pytest -n $(TEST_WORKERS) tests/unit

mlflow-ui: $(STAMP)
	$(PY) -m mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow/mlflow.db --host 127.0.0.1 --port $${MLFLOW_PORT:-5000}

clean:
	rm -rf runs exports reports mlflow/mlflow.db mlflow/mlflow.db.lock mlflow/artifacts mlflow/server
