"""Command lines: `fp8-convert` and `fp8kit {demo,convert}`."""

from __future__ import annotations

import json
import sys
import warnings

import click

from fp8kit.errors import Fp8kitError


def _fail(message: str, code: int = 1):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.command("convert", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src")
@click.argument("out")
@click.option("--scheme", type=click.Choice(["dynamic", "block", "tensor"]), required=True,
              help="dynamic: per-channel weights, per-token activations; block: 128x128 weight blocks; "
                   "tensor: one weight scale per tensor.")
@click.option("--format", "fmt", type=click.Choice(["compressed-tensors", "fp8"]), default="compressed-tensors",
              show_default=True, help="fp8 is the DeepSeek-V3 / Qwen3-*-FP8 layout (block and tensor only).")
@click.option("--ignore", multiple=True, metavar="REGEX",
              help="Keep modules whose name matches REGEX in source precision (repeatable; a 're:' prefix is accepted).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--max-shard-size", default="5GB", show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def fp8_convert(src, out, scheme, fmt, ignore, device, max_shard_size, overwrite, as_json):
    """Convert the safetensors checkpoint SRC (a directory or a Hub id org/name[@revision]) into FP8 at OUT."""
    from fp8kit.converter import convert

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = convert(src, out, scheme=scheme, format=fmt, ignore=list(ignore), device=device,
                             max_shard_size=max_shard_size, overwrite=overwrite, progress=sys.stderr.isatty())
    except Fp8kitError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail(f"interrupted; nothing was written to {out}", 130)
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(f"{report.out}: {len(report.quantized)} weights in FP8 ({scheme}, {fmt}), "
                   f"{len(report.ignored)} modules kept; {report.bytes_in / 1e9:.2f} GB -> {report.bytes_out / 1e9:.2f} GB "
                   f"in {report.seconds:.1f} s, peak RSS {report.peak_rss_bytes / 2**20:.0f} MiB", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fp8kit")
def main():
    """fp8kit: FP8 checkpoints for large language models."""


@main.command()
@click.option("--seed", default=0, show_default=True)
def demo(seed):
    """Build a tiny random Llama, convert it with every scheme, load each back, print a table."""
    from fp8kit.demo import format_table, run_demo

    try:
        rows = run_demo(seed=seed)
    except Fp8kitError as e:
        _fail(str(e))
    click.echo(format_table(rows))


main.add_command(fp8_convert)
