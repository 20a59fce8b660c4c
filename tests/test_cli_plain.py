"""The options of the commands served without click (`discover`, `metrics`) are
written once (`cli.plain.Option`): whatever the plain parser serves, click
parses to the same values."""

from __future__ import annotations

from typing import Any, Optional

import click
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib.cli import inventory, plain
from gpulib.cli import metrics as cli_metrics
from gpulib.cli.discover import discover

WORDS = ["-f", "--format", "--format=json", "--format=table", "--format=xml", "json",
         "cloudstack", "table", "--json", "--json=1", "-o", "--output", "--output=f.prom",
         "f.prom", "-", "", "extra", "--help"]


def click_values(command: click.Command, args: list[str]) -> Optional[dict[str, Any]]:
    try:
        ctx = command.make_context(command.name or "", list(args), resilient_parsing=False)
    except (click.exceptions.Exit, click.ClickException):
        return None
    return dict(ctx.params)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(WORDS), max_size=5))
def test_discover_plain_forms_are_clicks(args: list[str]) -> None:
    parsed = plain.parse(["discover", *args], "discover", inventory.OPTIONS)
    if parsed is None:
        return  # click's to parse (and to refuse)
    assert parsed[0] == 0
    assert click_values(discover, args) == parsed[1], args


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(WORDS), max_size=4))
def test_metrics_plain_forms_are_clicks(args: list[str]) -> None:
    parsed = plain.parse(["metrics", *args], "metrics", cli_metrics.OPTIONS)
    if parsed is None:
        return
    assert click_values(cli_metrics.metrics, args) == parsed[1], args


def test_the_agents_forms_are_plain() -> None:
    """What the agent and the metrics timer run is served without click."""
    assert inventory.parse_args(["discover", "--format", "cloudstack"]) == (0, "cloudstack")
    assert cli_metrics.parse_args(["metrics", "--output", "/x/gpulib.prom"]) == (
        0, "/x/gpulib.prom")
