"""Showing plans: text for terminals, Graphviz for people who would rather look.

The drawing puts the logical graph (before optimization) on the left and the physical plan
(after) on the right. In the physical plan every fused stage is a shaded box; exchanges are
bold dashed edges; the boundaries where the exactly-once runtime backs records up and
deduplicates them are marked with a red dot.

A drawing ``for_page`` (the live page, :mod:`onceflow.operations.ui`) is the physical plan
alone, with every stage box and node named by ``data-stage`` / ``data-node`` attributes.
"""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET
import zlib

from onceflow.graph_optimizer.errors import GraphError
from onceflow.graph_optimizer.ir import (
    Combine,
    Exchange,
    FlatMap,
    Graph,
    Node,
    Process,
    Sink,
    Source,
)
from onceflow.graph_optimizer.plan import BoundaryKind, Plan, Via


def _detail(node: Node) -> str:
    if isinstance(node, Source | Sink):
        return node.connector.describe() if node.connector is not None else ""
    if isinstance(node, Combine):
        text = f"{node.phase.value} {node.combine_fn.label if node.combine_fn else ''}".strip()
        if node.windowing is not None:
            text += f" | {node.windowing.describe()}"
        if node.ttl_ms is not None:
            text += f" | state ttl {node.ttl_ms} ms"
            text += ", then a delete" if node.expiry_deletes else ""
        return text
    if isinstance(node, Process) and node.process is not None:
        states = ", ".join(spec.describe() for spec in node.process.states) or "none"
        text = f"{node.label} | state: {states}"
        if node.process.ttl_ms is not None:
            text += f" | state ttl {node.process.ttl_ms} ms"
        return text
    return node.label or node.kind


def _kind(node: Node) -> str:
    if isinstance(node, FlatMap):
        return node.label.split()[0] if node.label else "flat_map"
    return node.kind


def logical_text(graph: Graph) -> str:
    """One line per node: name, kind, inputs, detail."""
    lines = [f"Logical plan of {graph.name!r} ({len(graph.nodes)} nodes)"]
    width = max((len(n.name) for n in graph), default=4)
    for node in graph:
        inputs = f" <- {', '.join(node.inputs)}" if node.inputs else ""
        keyed = " [keyed]" if graph.keyed[node.name] and not isinstance(node, Sink) else ""
        lines.append(f"  {node.name:<{width}}  {_kind(node):<9} {_detail(node)}{inputs}{keyed}")
    return "\n".join(lines)


def physical_text(plan: Plan) -> str:
    """Stages, their inputs and outputs, and the exactly-once boundaries."""
    bounds = plan.boundaries()
    lines = [f"Physical plan: {len(plan.stages)} stage(s), {len(bounds)} boundaries"]
    for stage in plan.ordered:
        lines.append(f"  stage {stage.name!r}: {' -> '.join(stage.nodes)}")
        if plan.is_source_stage(stage):
            lines.append(f"      in : source {stage.nodes[0]}")
        for e in plan.inbound(stage):
            via = f"exchange {e.exchange}" if e.via is Via.EXCHANGE else "direct"
            lines.append(
                f"      in : {via} from stage {plan.stage_of[e.producer]!r} "
                f"({e.producer} -> {e.consumer})"
            )
        for port in plan.ports(stage):
            via = f"exchange {port.exchange}" if port.via is Via.EXCHANGE else "direct"
            lines.append(f"      out: {via} ({port.producer})")
        sinks = [n for n in stage.nodes if isinstance(plan.graph[n], Sink)]
        if sinks:
            lines.append(f"      sink: {', '.join(sinks)}")
    lines.append("  Boundaries (backup before, dedup after, when exactly-once is on):")
    for b in bounds:
        sender = b.sender or "outside"
        lines.append(f"    {b.kind.value:<8} {b.name:<24} {sender} -> {b.receiver}")
    if plan.removed:
        lines.append(f"  Removed (reach no sink): {', '.join(plan.removed)}")
    return "\n".join(lines)


def explain_text(before: Graph, plan: Plan) -> str:
    """The logical graph and the physical plan, for ``onceflow explain``."""
    return logical_text(before) + "\n\n" + physical_text(plan)


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped + '"'


def _short(text: str, limit: int = 40) -> str:
    """Long labels show file names instead of full paths: that is what a reader recognises."""
    if len(text) <= limit:
        return text
    words = [w.rstrip("/").rsplit("/", 1)[-1] if "/" in w else w for w in text.split(" ")]
    short = " ".join(words)
    return short if len(short) <= limit else short[: limit - 3] + "..."


_SHAPES = {"source": "invhouse", "sink": "house", "exchange": "diamond", "combine": "box3d"}
_FILL = {"source": "#d9ead3", "sink": "#fce5cd", "exchange": "#eeeeee", "combine": "#cfe2f3"}


def _node_attrs(node: Node) -> str:
    kind = node.kind
    shape = _SHAPES.get(kind, "box")
    fill = _FILL.get(kind, "#ffffff")
    label = f"{node.name}\n{_short(_detail(node))}"
    return f'label={_quote(label)}, shape={shape}, style="filled,rounded", fillcolor="{fill}"'


def to_dot(before: Graph, plan: Plan, *, for_page: bool = False) -> str:
    """Graphviz DOT with the logical graph and the physical plan side by side.

    ``for_page`` draws the physical plan alone, without the logical graph and the legend (a
    page explains the drawing itself), and gives every stage box and node an SVG id that
    ``to_svg`` turns into its ``data-stage`` / ``data-node`` name.
    """
    out = [
        "digraph onceflow {",
        "  rankdir=TB; compound=true; newrank=true;",
        '  node [fontname="Helvetica", fontsize=11]; edge [fontname="Helvetica", fontsize=9];',
        f"  label={_quote(f'pipeline {before.name}')}; labelloc=t; fontsize=16;",
    ]
    if not for_page:
        out.extend(_logical_dot(before))
    out.extend(_physical_dot(plan, for_page))
    if not for_page:
        out.append(_LEGEND)
    out.append("}")
    return "\n".join(out) + "\n"


def _logical_dot(before: Graph) -> list[str]:
    out = [
        "  subgraph cluster_logical {",
        '    label="logical graph (before optimization)"; style=dashed; color="#999999";',
    ]
    for node in before:
        out.append(f"    L_{_id(node.name)} [{_node_attrs(node)}];")
    for node in before:
        for i in node.inputs:
            out.append(f"    L_{_id(i)} -> L_{_id(node.name)};")
    out.append("  }")
    return out


_LEGEND = (
    '  legend [shape=note, fontsize=9, label="shaded box = one fused stage (one Python pass)\\n'
    "red edge with a dot = boundary: backed up before, deduplicated after\\n"
    'dashed red = exchange (repartition by key)"];'
)
# A page's drawing: the SVG ids ``<kind>:<name>``, by kind: the attribute that names the
# group, and its title's prefix.
_PAGE_IDS = {"stage": ("data-stage", "stage "), "node": ("data-node", "")}
_SVG_NS = "http://www.w3.org/2000/svg"


def _id(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name) + f"_{zlib.crc32(name.encode()):08x}"


def _physical_dot(plan: Plan, for_page: bool) -> list[str]:
    graph = plan.graph
    out = [
        "  subgraph cluster_physical {",
        f'    label="physical plan (after): {len(plan.stages)} fused stage(s)"; '
        'style=dashed; color="#999999";',
    ]
    for n, stage in enumerate(plan.ordered):
        out.append(f"    subgraph cluster_stage_{n} {{")
        out.append(
            f"      label={_quote('stage ' + stage.name)}; style=filled; "
            'fillcolor="#f4f4fb"; color="#7777aa";'
            + (f" id={_quote('stage:' + stage.name)};" if for_page else "")
        )
        for name in stage.nodes:
            page_id = f", id={_quote('node:' + name)}" if for_page else ""
            out.append(f"      P_{_id(name)} [{_node_attrs(graph[name])}{page_id}];")
        out.append("    }")
    boundary_edges = {(b.name, b.kind) for b in plan.boundaries()}
    for node in graph:
        if isinstance(node, Exchange):
            continue
        for i in node.inputs:
            src = graph[i]
            if isinstance(src, Exchange):
                out.append(
                    f"    P_{_id(src.inputs[0])} -> P_{_id(node.name)} "
                    f'[style="bold,dashed", color="#cc0000", label={_quote("exchange " + i)}, '
                    "arrowtail=dot, dir=both];"
                )
            elif plan.stage_of[i] != plan.stage_of[node.name]:
                out.append(
                    f"    P_{_id(i)} -> P_{_id(node.name)} "
                    '[color="#cc0000", label="direct", arrowtail=dot, dir=both];'
                )
            elif isinstance(node, Sink) and (node.name, BoundaryKind.SINK) in boundary_edges:
                out.append(
                    f"    P_{_id(i)} -> P_{_id(node.name)} "
                    '[color="#cc0000", arrowtail=dot, dir=both];'
                )
            else:
                out.append(f"    P_{_id(i)} -> P_{_id(node.name)};")
    if plan.removed:
        removed = _quote("removed: " + ", ".join(plan.removed))
        out.append(f"    removed [shape=note, label={removed}];")
    out.append("  }")
    return out


def render(dot: str, fmt: str) -> bytes:
    """Render DOT to ``svg`` or ``png`` with Graphviz's ``dot``."""
    exe = shutil.which("dot")
    if exe is None:
        msg = (
            "drawing needs Graphviz's 'dot' program, which is not installed; install it "
            "(apt-get install graphviz) or use --format dot / text"
        )
        raise GraphError(msg)
    result = subprocess.run(
        [exe, f"-T{fmt}"], input=dot.encode(), capture_output=True, check=False, timeout=60
    )
    if result.returncode != 0:
        msg = f"dot failed ({result.returncode}): {result.stderr.decode(errors='replace')[:500]}"
        raise GraphError(msg)
    return result.stdout


def to_svg(before: Graph, plan: Plan, *, for_page: bool = False) -> str:
    """The drawing as SVG (needs Graphviz's ``dot``).

    ``for_page``: ``to_dot``'s page drawing, ready to inline into HTML (no XML declaration or
    DOCTYPE), every stage box and node named by ``data-stage`` / ``data-node``.
    """
    svg = render(to_dot(before, plan, for_page=for_page), "svg").decode("utf-8")
    return _named(svg) if for_page else svg


def _named(svg: str) -> str:
    """The ids ``to_dot`` gave a page's stage boxes and nodes, as their data attributes.

    Graphviz writes no attributes of ours but ids. Titles (shown on hover) become names too,
    instead of DOT ids.
    """
    ET.register_namespace("", _SVG_NS)
    ET.register_namespace("xlink", "http://www.w3.org/1999/xlink")
    root = ET.fromstring(svg)
    for group in root.iter(f"{{{_SVG_NS}}}g"):
        kind, colon, name = group.get("id", "").partition(":")
        if not colon or kind not in _PAGE_IDS:
            continue  # Graphviz's own ids (graph0, clust1, node1, edge1) have no colon
        attribute, title_prefix = _PAGE_IDS[kind]
        group.set(attribute, name)
        title = group.find(f"{{{_SVG_NS}}}title")
        if title is not None:
            title.text = title_prefix + name
    return ET.tostring(root, encoding="unicode")
