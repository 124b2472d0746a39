"""Command lines: `fp8-convert` and `fp8kit {demo,convert}`."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings
from pathlib import Path

import click

# light: torch is imported later, inside the commands
from fp8kit.converter.output import (InterruptedAfterWriting, interrupt_raised, interrupts_deferred,
                                     sigterm_as_interrupt, stdout_to_stderr)
from fp8kit.errors import Fp8kitError


def _fail(message: str, code: int = 1):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _ignore_interrupts() -> None:
    """The console script has finished (its output is complete and reported): a Ctrl-C or SIGTERM during the
    interpreter's shutdown (torch's teardown takes a moment) would end the process by that signal, without our line
    and with another status than the work's."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)


class _Interruptible:
    """Click commands whose interrupt (Ctrl-C, or SIGTERM from the start of main()) is one line and exit 130, never
    click's `Aborted!` and exit 1, a KeyboardInterrupt traceback or a silent death by SIGTERM. main() is the
    console scripts' entry (`fp8kit.cli:main`, `fp8kit.cli:fp8_convert`) and runs before torch and transformers
    are imported (fp8kit imports them lazily), so this holds in the first second too. `interrupted` says what an
    interrupt leaves, with the command's parameters filled in ({out}); a command that knows more catches
    KeyboardInterrupt itself (publish names the variant it was working on)."""

    def __init__(self, *args, interrupted: str = "nothing was changed", **kwargs):
        super().__init__(*args, **kwargs)
        self.interrupted = interrupted

    def __call__(self, *args, **kwargs):
        """The console scripts' entry (click's CliRunner calls main() instead, and keeps its process's handlers)."""
        try:
            return self.main(*args, **kwargs)
        finally:
            _ignore_interrupts()

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        # click's standalone mode, except that an interrupt in click's own steps (parsing the command line) is our
        # line and 130 too, not `Aborted!` and 1
        with sigterm_as_interrupt():
            try:
                rv = super().main(args, prog_name, complete_var, False, **extra)
            except KeyboardInterrupt:
                _fail("interrupted; nothing was changed", 130)
            except click.exceptions.Abort as e:
                # click makes an Abort of Ctrl-C (and SIGTERM, see above), and also of end of input (EOFError, e.g.
                # at a prompt): only the first is an interrupt
                if isinstance(e.__cause__ or e.__context__, KeyboardInterrupt):
                    _fail("interrupted; nothing was changed", 130)
                _fail("aborted")
            except click.ClickException as e:
                e.show()
                sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)  # an int is click's exit code (--help, --version, ctx.exit)

    def invoke(self, ctx):
        try:
            # torch first, with Ctrl-C and SIGTERM held until it is imported: a KeyboardInterrupt raised inside its
            # import was cleared by its C extension (the command then ran on) or aborted the process from pybind11
            # (exit -6, a C++ trace); held, it is raised here, before the command starts
            with interrupts_deferred():
                import torch  # noqa: F401
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _fail(f"interrupted; {self.interrupted.format(**ctx.params)}", 130)
        except Exception as e:
            if interrupt_raised():  # a later failure of an interrupted import (numpy half-loaded under torch's)
                _fail(f"interrupted; {self.interrupted.format(**ctx.params)}", 130)
            if isinstance(e, EOFError):  # end of input: an Abort here, before click's own handler prints a blank line
                raise click.exceptions.Abort() from e
            if isinstance(e, RuntimeError) and "home directory" in str(e):  # pathlib's expanduser() of `~someone`
                _fail(f"a path starting with '~' cannot be expanded ({e}); spell the path out")  # (an unknown user)
            raise


class _Command(_Interruptible, click.Command):
    pass


class _Group(_Interruptible, click.Group):
    command_class = _Command


_Group.group_class = _Group


@click.command("convert", cls=_Command, interrupted="nothing was written to {out}",
               context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src")
@click.argument("out")
@click.option("--scheme", type=click.Choice(["dynamic", "block", "tensor", "tensor-static"]), required=True,
              help="dynamic: per-channel weights, per-token activations; block: 128x128 weight blocks; "
                   "tensor: one weight scale per tensor; tensor-static: per-tensor weights and calibrated static "
                   "activation scales (needs llm-compressor and the model's tokenizer).")
@click.option("--calibration", type=click.Path(dir_okay=False), default=None,
              help="Calibration text for tensor-static and --kv-cache (default: a sample shipped with fp8kit).")
@click.option("--format", "fmt", type=click.Choice(["compressed-tensors", "fp8"]), default="compressed-tensors",
              show_default=True, help="fp8 is the DeepSeek-V3 / Qwen3-*-FP8 layout (block and tensor only).")
@click.option("--ignore", multiple=True, metavar="REGEX",
              help="Keep modules whose name matches REGEX in source precision (repeatable; a 're:' prefix is accepted).")
@click.option("--lm-head", is_flag=True,
              help="Quantize lm_head too (compressed-tensors; untied lm_head only): less weight memory in vLLM on "
                   "large vocabularies, less accurate logits.")
@click.option("--kv-cache", type=click.Choice(["fp8"]), default=None,
              help="Add calibrated FP8 KV-cache scales (compressed-tensors): vLLM then serves with an FP8 KV cache by "
                   "default. Runs the whole model over --calibration text; needs the model's tokenizer.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--max-shard-size", default="5GB", show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def fp8_convert(src, out, scheme, fmt, calibration, ignore, lm_head, kv_cache, device, max_shard_size, overwrite,
                as_json):
    """Convert the safetensors checkpoint SRC (a directory or a Hub id org/name[@revision]) into FP8 at OUT."""
    # SIGTERM unwinds like Ctrl-C (set up by main(), see _Interruptible), so the temporary output is removed.
    report = whole = None  # whole: OUT in place once convert() said so, for the line an interrupt after that prints
    try:
        from fp8kit.converter import convert
        from fp8kit.registry.cache import entry_lock, record_conversion, remove_unfinished

        # OUT inside the cache (the command `fp8kit resolve` prints): under the entry's lock, as ensure() converts,
        # so that a concurrent ensure() waits instead of removing this conversion's temporary folder as stale
        try:
            lock = entry_lock(out, src)
            if lock is not None:
                try:
                    lock.acquire(timeout=0)
                except TimeoutError:  # filelock.Timeout
                    click.echo(f"waiting for another conversion of {out} to finish", err=True)
                    lock.acquire()
                remove_unfinished(Path(out).expanduser().resolve())  # left by a killed one, as ensure() removes them
        except OSError as e:
            raise Fp8kitError(f"{out}: cannot write there ({e.strerror or e}); nothing was converted") from e
        # the entry ensure() makes (default options; tensor-static: the shipped sample): recorded, ensure() uses it
        recorded = lock is not None and not (ignore or lm_head or kv_cache or calibration) and \
            scheme in ("dynamic", "block", "tensor", "tensor-static")
        started = time.perf_counter()
        try:
            try:
                with warnings.catch_warnings(), stdout_to_stderr() if as_json else contextlib.nullcontext():
                    warnings.simplefilter("ignore")
                    report = convert(src, out, scheme=scheme, format=fmt, ignore=list(ignore), device=device,
                                     max_shard_size=max_shard_size, overwrite=overwrite, progress=sys.stderr.isatty(),
                                     calibration=calibration, lm_head=lm_head, kv_cache=kv_cache)
            except InterruptedAfterWriting as e:  # OUT is whole: recorded all the same
                whole = e.out
                if recorded:
                    record_conversion(src, out, scheme, fmt, time.perf_counter() - started)
                raise
            if recorded:
                record_conversion(src, out, scheme, fmt, report.seconds)
        finally:
            if lock is not None:
                lock.release()
    except Fp8kitError as e:
        _fail(str(e))
    except KeyboardInterrupt as e:
        written = e.out if isinstance(e, InterruptedAfterWriting) else whole or (report and report.out)
        if written is not None:  # in its final renames or after them, or while the cache recorded it
            _fail(f"interrupted once {written} was written completely; it holds the whole conversion", 130)
        _fail(f"interrupted; nothing was written to {out}", 130)
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(f"{report.out}: {len(report.quantized)} weights in FP8 ({scheme}, {fmt}), "
                   f"{len(report.ignored)} modules kept; {report.bytes_in / 1e9:.2f} GB -> {report.bytes_out / 1e9:.2f} GB "
                   f"in {report.seconds:.1f} s, peak RSS {_mib(report.peak_rss_bytes)}", err=True)


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:.0f} MiB"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fp8kit")
def main():
    """fp8kit: FP8 checkpoints for large language models."""


@main.command(interrupted="its temporary files were removed")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1),
              help="Seeds the random weights (torch.manual_seed's range).")
def demo(seed):
    """Build a tiny random Llama, convert it with dynamic, block and tensor, and block in the fp8 format, load each
    back, print a table."""
    from fp8kit.demo import format_table, run_demo

    try:
        rows = run_demo(seed=seed)
    except Fp8kitError as e:
        _fail(str(e))
    click.echo(format_table(rows))


main.add_command(fp8_convert)


@main.command("resolve")
@click.argument("name")
@click.option("--scheme", type=click.Choice(["auto", "dynamic", "block", "tensor", "tensor-static"]), default="auto",
              show_default=True, help="auto: dynamic where this machine has row-wise FP8 GEMMs (SM89+), else block. "
                                      "tensor-static converts with calibrated static activation scales (llm-compressor, "
                                      "the shipped calibration sample).")
@click.option("--json", "as_json", is_flag=True)
def resolve_cmd(name, scheme, as_json):
    """Which FP8 weights NAME gets: a pre-quantized upload, or the conversion that will run."""
    from fp8kit.registry import resolve

    try:
        answer = resolve(name, scheme)
    except Fp8kitError as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps(answer.to_dict(), indent=2))
    elif answer.repo_id and answer.name == answer.repo_id:
        # NAME is an upload itself: it is its own answer, whatever scheme was asked (or auto picked for this machine)
        asked = (f", so --scheme {scheme} does not apply" if scheme not in ("auto", answer.variant_scheme) else "")
        click.echo(f"{answer.repo_id}  ({answer.variant_scheme}, {answer.format}; from the {answer.source}; "
                   f"{name.strip()} is itself a {answer.variant_scheme} variant{asked})")
    elif answer.repo_id:
        click.echo(f"{answer.repo_id}  ({answer.variant_scheme}, {answer.format}; from the {answer.source}, "
                   f"answering {answer.scheme})")
    elif answer.cached:
        click.echo(f"no upload for {name} ({answer.scheme}); converted already, cached in:\n  {answer.cache_dir}")
    elif answer.cache_dir:
        click.echo(f"no upload for {name} ({answer.scheme}); will convert and cache:\n  {answer.convert_command}")
    else:  # the commit, which names the cache folder, is fetched by the conversion: no fp8-convert OUT to give
        revision = answer.name.partition("@")[2] or "main"
        click.echo(f"no upload for {name} ({answer.scheme}); will convert and cache in {answer.model_dir}, in the "
                   f"folder of {revision}'s commit (not known here yet); convert and cache it with:\n  "
                   f"{answer.convert_command}")


@main.group()
def registry():
    """The catalog of pre-quantized FP8 uploads (shipped, plus your overlay)."""


@registry.command("list")
@click.option("--family", default=None, help="Only this family (e.g. qwen3, llama-3.1, gemma-3).")
@click.option("--json", "as_json", is_flag=True)
def registry_list(family, as_json):
    from fp8kit.registry import load

    try:
        everything = load()
    except Fp8kitError as e:
        _fail(str(e))
    known = sorted({v.family for v in everything})
    if family is not None and family not in known:
        _fail(f"--family {family!r}: no such family in the catalog or your overlay; known: {', '.join(known)}", 2)
    variants = [v for v in everything if family is None or v.family == family]
    if as_json:
        click.echo(json.dumps([v.to_dict() for v in variants], indent=2))
        return
    for v in variants:
        click.echo(f"{v.repo_id:<56} {v.family:<18} {v.scheme:<13} {v.format:<19} {v.base[0]}"
                   + ("  [overlay]" if v.source == "overlay" else ""))


@main.group()
def cache():
    """Conversions fp8kit made and cached (FP8KIT_CACHE, default ~/.cache/fp8kit)."""


@cache.command("list")
@click.option("--json", "as_json", is_flag=True)
def cache_list(as_json):
    from fp8kit.registry.cache import list_entries, list_unfinished

    try:
        rows = list_entries()
    except Fp8kitError as e:  # the cache path is a file
        _fail(str(e))
    unfinished = list_unfinished()
    if as_json:  # unfinished folders last, with "status": "unfinished"
        click.echo(json.dumps(rows + unfinished, indent=2))
        return
    for r in rows:
        click.echo(f"{r['name'] or '?':<40} {r['scheme'] or '?':<13} {r['bytes'] / 1e9:7.2f} GB  "
                   f"{'ok' if r['ok'] else 'BROKEN'}  {r['path']}")
    for r in unfinished:
        click.echo(f"{r['name'] or '(unfinished conversion)':<40} {r['scheme'] or '?':<13} {r['bytes'] / 1e9:7.2f} GB  "
                   f"UNFINISHED  {r['path']}")
    if unfinished:
        click.echo("UNFINISHED: a conversion in progress, or one killed outright; the next conversion of that model "
                   "or `fp8kit cache rm NAME` (NAME as listed) removes it", err=True)


@cache.command("rm", interrupted="some of the entries may be removed already: run it again to finish")
@click.argument("name", required=False)
@click.option("--all", "remove_all", is_flag=True, help="Remove every cached conversion.")
def cache_rm(name, remove_all):
    """Remove the cached conversions of NAME (or --all)."""
    from fp8kit.registry.cache import remove

    if name and not Path(name).expanduser().is_dir():  # a pasted name's stray spaces, as resolve strips them
        name = name.strip()
    if bool(name) == remove_all:
        _fail("give a model NAME or --all, not both" if remove_all else "give a model NAME or --all", 2)
    try:
        removed = remove(None if remove_all else name)
    except Fp8kitError as e:
        _fail(str(e))
    if name and not removed:
        _fail(f"nothing cached for {name!r}: `fp8kit cache list` shows the cached names")
    for path in removed:
        click.echo(f"removed {path}")


@main.command()
@click.argument("src", required=False)
@click.option("--base-model", default=None, metavar="ORG/NAME", help="The source's Hub name (required for a local SRC).")
@click.option("--scheme", "schemes", multiple=True, type=click.Choice(["dynamic", "block", "tensor", "tensor-static"]),
              help="Repeat for several variants. tensor-static: as fp8-convert's (activation scales calibrated on "
                   "--calibration text).")
@click.option("--format", "fmt", type=click.Choice(["compressed-tensors", "fp8"]), default="compressed-tensors",
              show_default=True, help="fp8 is the DeepSeek-V3 / Qwen3-*-FP8 layout (block only).")
@click.option("--kv-cache", type=click.Choice(["fp8"]), default=None,
              help="As fp8-convert's: calibrated FP8 KV-cache scales, so vLLM serves an FP8 KV cache by default.")
@click.option("--calibration", type=click.Path(dir_okay=False), default=None,
              help="Calibration text for tensor-static and --kv-cache (default: a sample shipped with fp8kit).")
@click.option("--lm-head", is_flag=True, help="As fp8-convert's: quantize lm_head too (untied lm_head only).")
@click.option("--ignore", multiple=True, metavar="REGEX",
              help="As fp8-convert's: keep modules whose name matches REGEX in source precision (repeatable).")
@click.option("--repo-template", default="{org}/{name}-FP8-{Scheme}", show_default=True)
@click.option("--org", default=None, help="Where to publish (default: the token's user).")
@click.option("--private", is_flag=True)
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to main.")
@click.option("--max-kl", type=float, default=None,
              help="Do not upload variants whose mean KL is above this (a positive number, e.g. 0.01).")
@click.option("--dry-run", is_flag=True, help="Convert, validate and stage only; contact no server.")
@click.option("--staging", type=click.Path(file_okay=False), default=None, help="Where staged variants go.")
@click.option("--force", is_flag=True, help="Upload into an existing repo that fp8kit did not make (or made from "
                                             "another base model); its files are replaced by the staged ones.")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="A TOML plan of many models x schemes; goes on past failures. Its [[model]] tables give SRC, "
                   "--base-model and --scheme; the other options that name a variant's content or repo are its "
                   "defaults.")
@click.option("--json", "as_json", is_flag=True)
def publish(src, base_model, schemes, fmt, kv_cache, calibration, lm_head, ignore, repo_template, org, private,
            create_pr, max_kl, dry_run, staging, force, plan_path, as_json):
    """Convert SRC to FP8, validate it against the source, write its model card, upload and register it."""

    results = []
    try:
        from fp8kit.hub.publish import (PublishResult, check_format, check_max_kl, check_repo_template,
                                        publish as run, read_plan, repo_id_for)

        check_repo_template(repo_template)  # once, not once per plan entry
        check_max_kl(max_kl)
        defaults = dict(repo_template=repo_template, org=org, max_kl=max_kl, fmt=fmt, kv_cache=kv_cache,
                        calibration=calibration, lm_head=lm_head, ignore=list(ignore))
        if plan_path:
            jobs = _plan_jobs(Path(plan_path), read_plan, src, base_model, schemes, defaults, dry_run)
        elif src and schemes:
            check_format(fmt, schemes)
            jobs = [dict(src=src, schemes=list(dict.fromkeys(schemes)), base_model=base_model, **defaults)]
        else:
            _fail("give SRC and at least one --scheme, or --plan FILE", 2)
        for job in jobs:
            try:
                # the card's "How it was made" is built by publish() from the variant's own arguments: the host's
                # command line would carry --dry-run, --staging, --plan and local paths. llm-compressor's log
                # (tensor-static) goes to stderr, as fp8-convert's: stdout holds the report alone
                with stdout_to_stderr():
                    results += run(**job, private=private, create_pr=create_pr, dry_run=dry_run, staging=staging,
                                   force=force)
            except Fp8kitError as e:
                if not plan_path:
                    raise
                # the rows name the repos the entry was to publish: publish() knows the token's user once it asked
                repo_ids = getattr(e, "repo_ids", None) or [
                    repo_id_for(job["repo_template"], job["org"] or "{token user}",
                                job["base_model"] or job["src"].partition("@")[0], s) for s in job["schemes"]]
                results += [PublishResult(r, s, "failed", error=str(e)) for r, s in zip(repo_ids, job["schemes"])]
    except Fp8kitError as e:
        _fail(str(e))
    except KeyboardInterrupt as e:
        import shutil

        if dry_run and not staging:  # earlier plan entries' staging folders: the report that names them is not shown
            for r in results:
                if r.staging:
                    shutil.rmtree(Path(r.staging).parent, ignore_errors=True)
        _fail(str(e) or ("interrupted; nothing partial was left" if results else
                         "interrupted before any conversion; nothing was converted, staged or uploaded"), 130)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2, allow_nan=False))
    else:
        for r in results:
            size = sum(r.files.values()) / 1e9
            kl = f"{r.metrics['kl']:.2e}" if r.metrics else "-"
            click.echo(f"{r.status:<10} {r.repo_id:<50} {r.scheme:<13} KL {kl:<9} {size * 1000:9.1f} MB  "
                       f"{r.url or r.staging or ''}{'  ' + r.error if r.error else ''}")
            if r.kept_in_source_precision:
                why = "--ignore, or the scheme cannot take their shapes" if any(job["ignore"] for job in jobs) else \
                    "the scheme cannot take their shapes"
                click.echo(f"    {len(r.kept_in_source_precision)} Linear layers kept in the source precision "
                           f"({why}), e.g. {r.kept_in_source_precision[0]}")
            if r.status == "dry-run":
                for name, n in r.files.items():
                    click.echo(f"    {name:<40} {n:>14,d} bytes")
    if any(r.status in ("failed", "rejected") for r in results):
        sys.exit(1)


def _plan_jobs(path, read_plan, src, base_model, schemes, defaults: dict, dry_run) -> list[dict]:
    """The plan's jobs. Its [[model]] tables give src, base_model and schemes, so SRC, --base-model and --scheme are
    refused beside it; the other options in `defaults` (publish()'s arguments of those names) are its defaults,
    refused where its top level sets them. An entry without an org publishes under the token's user, looked up here
    (not in a dry run, which needs an org): its repos then compare with an entry that names that user as its org."""
    from click.core import ParameterSource

    from fp8kit.hub.publish import calibrates, check_format, check_variant_options, conversion_options

    per_run = [name for name, given in (("SRC", src), ("--base-model", base_model), ("--scheme", schemes)) if given]
    if per_run:
        _fail(f"--plan {path}: its [[model]] tables give src, base_model and schemes; drop {', '.join(per_run)} from "
              f"the command line, or drop --plan", 2)
    plan = read_plan(path)
    context = click.get_current_context()
    # the plan's key, publish()'s argument (the click parameter's name), the option
    keys = [(key, key, "--" + key.replace("_", "-")) for key in ("org", "max_kl", "repo_template", "kv_cache",
                                                                   "calibration", "lm_head", "ignore")]
    keys.append(("format", "fmt", "--format"))
    both = [(key, option) for key, param, option in keys
            if key in plan and context.get_parameter_source(param) != ParameterSource.DEFAULT]
    if both:
        _fail(f"--plan {path}: its top level sets " + " and ".join(repr(k) for k, _ in both) + ", and the command line "
              f"gives " + " and ".join(o for _, o in both) + "; keep one (the command line's value is the default of a "
              f"plan that has none)", 2)
    jobs = [dict(src=m["src"], schemes=list(dict.fromkeys(m["schemes"])), base_model=m.get("base_model"),
                 **{param: m.get(key, plan.get(key, defaults[param])) for key, param, _ in keys})
            for m in plan["model"]]
    for m, job in zip(plan["model"], jobs):
        job["kv_cache"] = job["kv_cache"] or None  # an entry's `kv_cache = false` turns a default off
        if not any(calibrates(s, job["kv_cache"]) for s in job["schemes"]) and "calibration" not in m:
            job["calibration"] = None  # a default calibration is for the entries that calibrate
    options = []  # each entry's conversion_options of each scheme, as its variants record them
    for i, (m, job) in enumerate(zip(plan["model"], jobs)):  # each entry's format, named where it was set
        check_format(job["fmt"], job["schemes"], f"{path}: [[model]] number {i + 1}: format" if "format" in m else
                     f"{path}: top-level format (for [[model]] number {i + 1})" if "format" in plan else
                     f"--format (for {path}'s [[model]] number {i + 1})")
        try:  # fp8-convert's options, and the calibration text read, before the first entry is converted
            check_variant_options(job["schemes"], job["fmt"], job["ignore"], job["lm_head"], job["kv_cache"],
                                  job["calibration"])
            options.append({s: conversion_options(job["kv_cache"], job["calibration"], job["lm_head"], job["ignore"], s)
                            for s in job["schemes"]})
        except Fp8kitError as e:
            raise Fp8kitError(f"{path}: [[model]] number {i + 1}: {e}") from e
    _check_plan_names(path, jobs)
    if not dry_run and any(not job["org"] for job in jobs):
        from fp8kit.hub.publish import token_user

        user = token_user()
        for job in jobs:
            job["org"] = job["org"] or user
        _check_plan_names(path, jobs)  # the repo names the user gives them
    _refuse_shared_repos(path, jobs, options)
    return jobs


def _check_plan_names(path, jobs: list[dict]) -> None:
    """Every entry's base model and repo names, as publish() checks them, before the first entry is converted: a bad
    name in a later entry was found after earlier ones were uploaded."""
    from fp8kit.hub.publish import check_hub_names, repo_id_for
    from fp8kit.registry.catalog import is_repo_name

    for i, job in enumerate(jobs):
        base = job["base_model"] or job["src"].partition("@")[0]
        if not is_repo_name(base):
            field = "base_model" if job["base_model"] else "src"
            raise Fp8kitError(f"--plan {path}: [[model]] number {i + 1}: {field} {base!r} is not a Hub repo id "
                              f"ORG/NAME")
        if job["org"]:  # without one the token's user names the repos, checked when publish() asks for it
            try:
                check_hub_names([repo_id_for(job["repo_template"], job["org"], base, s) for s in job["schemes"]])
            except Fp8kitError as e:
                raise Fp8kitError(f"--plan {path}: [[model]] number {i + 1}: {e}") from e


def _refuse_shared_repos(path, jobs: list[dict], options: list[dict]) -> None:
    """Two [[model]] entries whose variants land in one repo (the default template fills it from the name alone, so
    org-a/Foo and org-b/Foo collide, and one model's two formats): the later upload would replace the earlier one's
    weights under its name. `options`: each entry's conversion_options of each scheme."""
    import shlex

    from fp8kit.hub.publish import convert_args, repo_id_for

    seen = {}
    for i, (job, recorded) in enumerate(zip(jobs, options)):
        for scheme in job["schemes"]:
            # what the variant holds: the model, the format and fp8-convert's options (one model with and without an
            # FP8 KV cache are two variants)
            args = convert_args(job["kv_cache"], job["calibration"], job["lm_head"], job["ignore"], scheme)
            label = ", ".join([job["src"], job["fmt"]] + ([shlex.join(args)] if args else []))
            source = (job["src"], job["base_model"] or job["src"].partition("@")[0], job["fmt"],
                      json.dumps(recorded[scheme], sort_keys=True))
            # an entry without org publishes under the token's user: one name for all such entries
            repo_id = repo_id_for(job["repo_template"], job["org"] or "{token user}", source[1], scheme)
            j, other, other_label = seen.setdefault(repo_id.lower(), (i, source, label))
            if other != source:
                _fail(f"--plan {path}: [[model]] number {j + 1} ({other_label}) and number {i + 1} ({label}) both "
                      f"publish {scheme} to {repo_id}; give one of them another repo_template or org", 2)


if __name__ == "__main__":
    main()
