"""The panel kinds of kvobs's dashboard, on grafana-foundation-sdk's builders: one function per kind,
so every panel of a kind looks and behaves alike (legend, zero series hidden, NaN shown as no data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
    common as common_builders,
    dashboard as dashboard_builders,
    heatmap,
    prometheus,
    stat,
    table,
    text,
    timeseries,
)
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import common, dashboard as model
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode, HeatmapColorScale
from grafana_foundation_sdk.models.prometheus import PromQueryFormat
from grafana_foundation_sdk.models.text import TextMode

NO_DATA = "No data"
"""What a panel shows where its query returns nothing (or NaN, a ratio of nothing to nothing)."""


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    exemplar: bool = False


def _target(query: Query, ref: str, ds: model.DataSourceRef, *, instant: bool = False,
            fmt: PromQueryFormat | None = None) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(query.expr).ref_id(ref).legend_format(query.legend).datasource(ds)
    target = target.instant() if instant else target.range()
    if query.exemplar:
        target = target.exemplar(True)
    if fmt is not None:
        target = target.format(fmt)
    return target


def _refs(queries: list[Query]) -> list[tuple[str, Query]]:
    return [(chr(ord("A") + i), q) for i, q in enumerate(queries)]


def _steps(*steps: tuple[str, float | None]) -> dashboard_builders.ThresholdsConfig:
    return dashboard_builders.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(
        [model.Threshold(color=color, value=value) for color, value in steps])


NAN_AS_NO_DATA = [model.SpecialValueMap(options=model.DashboardSpecialValueMapOptions(
    match=model.SpecialValueMatch.NA_N, result=model.ValueMappingResult(text=NO_DATA, color="text")))]
"""NaN (a quantile or ratio of nothing) reads "No data" in the text colour, never a threshold's green."""

HIDE_ALL_ZERO = (
    model.MatcherConfig(id_val="byValue", options={"reducer": "max", "op": "lte", "value": 0}),
    [model.DynamicConfigValue(id_val="custom.hideFrom", value={"legend": True, "tooltip": True, "viz": True})],
)
"""Grafana's "fields with values" override: a series whose largest value in the range is 0 (a cause,
reason or stage that never happened) is hidden from the graph, legend and tooltip."""


@dataclass
class Spec:
    """A panel's builder and its size; :func:`layout` places it."""

    builder: cogbuilder.Builder[Any]
    w: int
    h: int


def timeseries_panel(pid: int, title: str, description: str, queries: list[Query], ds: model.DataSourceRef, *,
                     unit: str, w: int = 8, h: int = 8, bars: bool = False, stack: bool = False,
                     hide_zero: bool = True, threshold_line: float | None = None) -> Spec:
    """A graph over time. ``bars``: one bar per step (counts); ``hide_zero``: series all 0 in the range hidden."""
    panel = (
        timeseries.Panel().id(pid).title(title).description(description).datasource(ds).unit(unit).min(0)
        .no_value(NO_DATA)
        .draw_style(common.GraphDrawStyle.BARS if bars else common.GraphDrawStyle.LINE)
        .fill_opacity(60 if bars else 10).line_width(1).span_nulls(False)
        .show_points(common.VisibilityMode.NEVER)
        .stacking(common_builders.StackingConfig().mode(
            common.StackingMode.NORMAL if stack else common.StackingMode.NONE).group("A"))
        .legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.BOTTOM).show_legend(True).calcs(["max", "lastNotNull"]))
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                 .sort(common.SortOrder.DESCENDING))
    )
    if threshold_line is not None:
        panel = panel.thresholds(_steps(("transparent", None), ("orange", threshold_line))).thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE))
    if hide_zero:
        panel = panel.with_override(*HIDE_ALL_ZERO)
    for ref, query in _refs(queries):
        panel = panel.with_target(_target(query, ref, ds))
    return Spec(panel, w, h)


def stat_panel(pid: int, title: str, description: str, query: Query, ds: model.DataSourceRef, *, unit: str,
               steps: tuple[tuple[str, float | None], ...], w: int = 4, h: int = 4) -> Spec:
    """One number now (an instant query); no data and NaN read "No data", never a colour of the thresholds."""
    panel = (
        stat.Panel().id(pid).title(title).description(description).datasource(ds).unit(unit)
        .no_value(NO_DATA).mappings(list(NAN_AS_NO_DATA)).thresholds(_steps(*steps))
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False).fields(""))
        .color_mode(common.BigValueColorMode.VALUE).graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.AUTO)
        .with_target(_target(query, "A", ds, instant=True))
    )
    return Spec(panel, w, h)


def bargauge_panel(pid: int, title: str, description: str, query: Query, ds: model.DataSourceRef, *,
                   w: int = 8, h: int = 8) -> Spec:
    """Histogram buckets counted over the range, one bar each (an instant query, heatmap format: sorted by le)."""
    panel = (
        bargauge.Panel().id(pid).title(title).description(description).datasource(ds).unit("short").min(0)
        .no_value(NO_DATA).orientation(common.VizOrientation.VERTICAL)
        .display_mode(common.BarGaugeDisplayMode.GRADIENT).show_unfilled(True)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False).fields(""))
        .with_target(_target(query, "A", ds, instant=True, fmt=PromQueryFormat.HEATMAP))
    )
    return Spec(panel, w, h)


def heatmap_panel(pid: int, title: str, description: str, query: Query, ds: model.DataSourceRef, *,
                  w: int = 8, h: int = 8) -> Spec:
    """Buckets per step as Prometheus stores them (no re-bucketing by Grafana); empty buckets not drawn."""
    panel = (
        heatmap.Panel().id(pid).title(title).description(description).datasource(ds)
        .calculate(False).cell_gap(1).show_legend().show_value(common.VisibilityMode.NEVER)
        .color(heatmap.HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges")
               .scale(HeatmapColorScale.EXPONENTIAL)
               .exponent(0.5).steps(64).fill("dark-orange").reverse(False))
        .filter_values(heatmap.FilterValueRange().le(1e-9))
        .y_axis(heatmap.YAxisConfig().unit("s").axis_placement(common.AxisPlacement.LEFT))
        .exemplars_color("rgba(255,0,255,0.7)")
        .with_target(_target(query, "A", ds, fmt=PromQueryFormat.HEATMAP))
    )
    return Spec(panel, w, h)


def table_panel(pid: int, title: str, description: str, queries: list[Query], ds: model.DataSourceRef, *,
                w: int = 8, h: int = 8) -> Spec:
    """Label sets as rows (instant queries, table format), time and value columns hidden, queries merged."""
    panel = (
        table.Panel().id(pid).title(title).description(description).datasource(ds).show_header(True)
        .no_value(NO_DATA)
        .with_transformation(model.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(model.DataTransformerConfig(id_val="organize", options={
            "excludeByName": {"Time": True, **{f"Value #{ref}": True for ref, _ in _refs(queries)}, "Value": True}}))
    )
    for ref, query in _refs(queries):
        panel = panel.with_target(_target(query, ref, ds, instant=True, fmt=PromQueryFormat.TABLE))
    return Spec(panel, w, h)


def text_panel(pid: int, title: str, content: str, *, w: int = 24, h: int = 3) -> Spec:
    return Spec(text.Panel().id(pid).title(title).mode(TextMode.MARKDOWN).content(content), w, h)


def row(pid: int, title: str) -> Spec:
    return Spec(dashboard_builders.Row(title).id(pid), 24, 1)


def sized(specs: list[Spec]) -> list[cogbuilder.Builder[Any]]:
    """Each builder with its size; the SDK's Dashboard places them left to right from the last row, so each
    row's panels fill Grafana's 24 columns exactly (checked here)."""
    width = 0
    for spec in specs:
        if isinstance(spec.builder, dashboard_builders.Row):
            assert width % 24 == 0, f"a line of panels before {spec.builder.build().title!r} is not 24 wide"
            width = 0
        else:
            width += spec.w
        spec.builder.grid_pos(model.GridPos(h=spec.h, w=spec.w))  # type: ignore[attr-defined]
    assert width % 24 == 0, "the last line of panels is not 24 wide"
    return [spec.builder for spec in specs]
