// ComfyUI frontend extension for tome's ToMe nodes: says on the node, in plain words, what ToMe will do (before a
// run: the token reduction per UNet level at the sampler's latent size) and what it did (after a run: the model by
// the name users know, the mode and ratio used, levels or blocks reduced, the speed check's verdict). Shows the
// "-1 = model default" widgets as "model default". Canvas text only (no HTML is built), no network calls; values
// come from the node's widgets, the graph and the server's messages of the last run.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { DEFAULTS, MODEL_DEFAULT, NODE_IDS, WANVIDEO_NODE_ID, describeLevels } from "./tome_levels.js";

// Sent by the server (nodes/ui_messages.py) when the speed check decides during sampling, or the patch adds a note.
export const LEVELS_EVENT = "tome.levels";

export const FONT = "12px sans-serif";
export const LINE_HEIGHT = 16;
export const PADDING = 10;  // left and right of the lines, inside the node
const MAX_HOPS = 12;
const SETTINGS = ["ratio", "max_downsample", "sx", "sy", "mode", "min_tokens", "start_percent", "end_percent"];
// The widgets whose -1 means "the model's default" (nodes/tome_nodes.py RATIO, BLOCK_INPUTS).
export const DEFAULT_WIDGETS = ["ratio", "block_start"];

function linkById(graph, id) {
  const links = graph?.links;
  if (!links) return undefined;
  return typeof links.get === "function" ? links.get(id) : links[id];
}

function widgetValue(node, name) {
  const widget = node?.widgets?.find((w) => w.name === name);
  return widget ? widget.value : undefined;
}

const number = (value) => String(Number(Number(value).toFixed(3)));

// Follow the MODEL output through other model patches to a sampler, then to its empty latent.
export function findLatentSize(node, graph) {
  const queue = [[node, 0]];
  const seen = new Set();
  while (queue.length) {
    const [current, hops] = queue.shift();
    if (!current || seen.has(current.id) || hops > MAX_HOPS) continue;
    seen.add(current.id);
    const latentInput = current.inputs?.find((input) => input.name === "latent_image");
    if (latentInput && latentInput.link != null) {
      const origin = graph.getNodeById(linkById(graph, latentInput.link)?.origin_id);
      const width = Number(widgetValue(origin, "width"));
      const height = Number(widgetValue(origin, "height"));
      if (width > 0 && height > 0) return { width, height };
    }
    for (const output of current.outputs ?? []) {
      if (output.type !== "MODEL") continue;
      for (const id of output.links ?? []) {
        queue.push([graph.getNodeById(linkById(graph, id)?.target_id), hops + 1]);
      }
    }
  }
  return null;
}

// ---- "model default": a choice in words, never a -1.00 to step through ---------------------------------------------

// What the widget shows at -1: after a run that used the model's default, which one (e.g. "merge 0.2 (Flux default)")
// while the node's mode is still the one run; before, "model default".
export function defaultWords(node, name) {
  const run = node.tomeLastRun;
  const mode = widgetValue(node, "mode");
  if (name === "ratio" && run?.defaults?.includes("ratio") && run.name && (mode === undefined || mode === run.mode)) {
    return `${run.mode} ${number(run.ratio)} (${run.name} default)`;
  }
  return "model default";
}

// Where an explicit value starts when the user leaves "model default" (one arrow click, a drag): the model's default
// ratio the last run used, else tomesd's 0.5; block_start: 0, the first block.
export function explicitStart(node, name) {
  if (name !== "ratio") return 0;
  return node.tomeLastRun?.default_ratio ?? DEFAULTS.ratio;
}

// Values between -1 and 0 mean nothing (the server refuses them): a step up from -1 lands on the explicit start, a
// step down from 0 (or any small negative value typed) on -1.
export function snapDefault(value, start) {
  const v = Number(value);
  if (!(v > MODEL_DEFAULT && v < 0)) return value;
  return v <= MODEL_DEFAULT / 2 ? start : MODEL_DEFAULT;
}

// Wrap the node's "-1 = model default" widgets: every change is snapped (the widget's callback, which ComfyUI's
// frontends call after an arrow click, a drag or a typed value), and -1 is drawn in words where the frontend draws a
// number widget's text from ``_displayValue`` (1.x); the 2024 frontend draws the number itself, so its label says it.
export function offerModelDefault(node) {
  for (const widget of node.widgets ?? []) {
    if (!DEFAULT_WIDGETS.includes(widget.name) || widget.tomeModelDefault) continue;
    widget.tomeModelDefault = true;
    const callback = widget.callback;
    widget.callback = function (value, ...rest) {
      const snapped = snapDefault(value, explicitStart(node, widget.name));
      if (snapped !== value) widget.value = snapped;
      node.setDirtyCanvas?.(true, false);
      return callback?.call(this, widget.value, ...rest);
    };
    if ("_displayValue" in widget) {
      Object.defineProperty(widget, "_displayValue", {
        configurable: true,
        get() {
          if (widget.computedDisabled) return "";
          if (Number(widget.value) === MODEL_DEFAULT) return defaultWords(node, widget.name);
          return Number(widget.value).toFixed(widget.options?.precision ?? 2);
        },
      });
    } else {
      widget.label = `${widget.name} (-1 = model default)`;
    }
  }
}

// ---- the lines under the widgets --------------------------------------------------------------------------------------

// How mode merge's attention weighs the merged keys (tome_core.engine.token_merge.ATTENTION_WORDS); plain: no line.
const ATTENTION_LINES = {
  balanced: "balanced attention: the merged image keys weigh as the image's tokens against the text",
  proportional: "proportional attention: each merged key weighs as the tokens it holds",
};

// "merge 0.5 (model default)" / "kv 0.75": the mode and ratio a run used.
function settingWords(run) {
  return `${run.mode} ${number(run.ratio)}${run.defaults?.includes("ratio") ? " (model default)" : ""}`;
}

// One speed-check verdict in words: what was decided and why, e.g. "reduced · not timed: CPU" or
// "left whole · ToMe measured 0.86x (slower) on cuda:0 (NVIDIA H100)". ``v``: a verdict record (engine Verdict.record).
export function verdictWords(v) {
  const where = v.device === "cpu" ? "CPU" : v.device;
  if (v.speedup == null) return `${v.reduce ? "reduced" : "left whole"} · not timed: ${v.untimed ?? where}`;
  const alone = v.timed && v.timed !== "the model call" ? " (its self-attention alone)" : "";
  return v.reduce ? `reduced · ${Number(v.speedup).toFixed(2)}x faster on ${where}${alone}`
                  : `left whole · ToMe measured ${Number(v.speedup).toFixed(2)}x (slower) on ${where}${alone}`;
}

// The speed check's part: the verdicts the server sent for this run, or what will decide.
export function speedCheckLines(node) {
  const check = widgetValue(node, "speed_check") ?? node.tomeLastRun?.speed_check ?? "auto";
  if (check === "off") return node.tomeLastRun ? ["speed check off: always reduced"] : [];
  const verdicts = node.tomeMessage?.verdicts ?? [];
  if (verdicts.length) {
    const sizes = new Set(verdicts.map((v) => String(v.pixels)));
    return verdicts.map((v) => {
      if (v.call) return `${v.call}: ${verdictWords(v)}`;
      const at = sizes.size > 1 && v.pixels ? ` at ${v.pixels[0]}x${v.pixels[1]} px` : "";
      return `level ${v.level}${at}: ${verdictWords(v)}`;
    });
  }
  if (node.tomeLastRun) return [`speed check ${check}: decided at the first step`];
  return check === "on" ? ["speed check on: timed at the first step (the result is shown here)"]
                        : ["speed check auto: timed at the first step on a GPU (the result is shown here); the CPU is "
                           + "not timed"];
}

// A DiT (Flux, Qwen-Image, Wan, LTX-2, ...) has no UNet levels: the last run's mode, ratio, blocks and notes.
export function ditLines(run, notes = []) {
  const weighed = ATTENTION_LINES[run.merge_attention]
    && !notes.some((line) => line.startsWith(`${run.merge_attention} attention needs a mask;`));
  const window = run.kv_window ?? [];
  const kept = window.reduce((a, b) => a * b, 1);
  const merged = Math.round((run.ratio ?? 0) * 100);
  const lines = [`${run.name ?? run.model_type} · ${settingWords(run)}`];
  if (run.mode === "merge") {
    lines.push(merged > 0 ? `${merged}% of the image tokens merged through each reduced block; text kept`
                          : "ratio 0: nothing reduced");
    if (merged > 0 && weighed) lines.push(ATTENTION_LINES[run.merge_attention]);
  } else {
    lines.push(kept > 1 ? `keys/values: 1 of ${kept} per ${window.join("x")} window; every query kept`
                        : "ratio too low for a window: nothing reduced");
  }
  const [reduced, total] = run.blocks ?? [];
  if (total > 0) lines.push(reduced === total ? `blocks reduced: all ${total}` : `blocks reduced: ${reduced} of ${total}`);
  if (run.quality) lines.push(run.quality);  // the family's default and a higher ratio against tomesd's error
  return [...lines, ...notes];
}

export function infoLines(node, graph) {
  const settings = {};
  for (const name of SETTINGS) {
    const value = widgetValue(node, name);
    if (value !== undefined) settings[name] = value;
  }
  const run = node.tomeLastRun;
  if (run?.family) return [...ditLines(run, node.tomeMessage?.notes ?? []), ...speedCheckLines(node)];
  if (node.tomeNodeId === WANVIDEO_NODE_ID) {  // a WanVideoWrapper model: no UNet levels to draw before the run
    const ratio = settings.ratio === undefined || settings.ratio === MODEL_DEFAULT ? "model default" : settings.ratio;
    return [`WanVideoWrapper · mode ${settings.mode ?? "merge"}, ratio ${ratio}; the plan is shown after the run`];
  }
  const base = run?.base_downsample ?? 1;
  const size = findLatentSize(node, graph);
  const width = size?.width ?? 512;
  const height = size?.height ?? 512;
  const pixels = `${width}x${height} px${size ? "" : " (assumed: no sampler's latent found)"}`;
  let head;
  if (run) {
    head = [`${run.name ?? run.model_type} · ${settingWords(run)} · ${pixels}`];
  } else if (settings.ratio === MODEL_DEFAULT) {
    head = [pixels, "ratio: model default (drawn at 0.5, SD1.5's; a transformer's own is shown after the run)"];
  } else {
    head = [pixels, `${settings.mode ?? "merge"} ${number(settings.ratio ?? DEFAULTS.ratio)} (levels as on SD1.5)`];
  }
  const drawn = run ? { ...settings, ratio: run.ratio, mode: run.mode } : settings;
  return [...head, ...describeLevels(width, height, drawn, base), ...speedCheckLines(node)];
}

// Greedy word wrap of ``lines`` to ``width`` (``measure(text)``: its width in the node's font); a word wider than the
// whole line is cut where it must be.
export function wrapLines(lines, width, measure) {
  const out = [];
  for (const line of lines) {
    let current = "";
    for (const word of String(line).split(" ")) {
      const candidate = current ? `${current} ${word}` : word;
      if (measure(candidate) <= width) {
        current = candidate;
        continue;
      }
      if (current) out.push(current);
      current = word;
      while (measure(current) > width && current.length > 1) {
        let cut = current.length - 1;
        while (cut > 1 && measure(current.slice(0, cut)) > width) cut--;
        out.push(current.slice(0, cut));
        current = current.slice(cut);
      }
    }
    out.push(current);
  }
  return out;
}

// The lines as drawn on ``node`` with ``ctx`` (its font set): wrapped to the node's width.
export function drawnLines(node, ctx, graph) {
  return wrapLines(infoLines(node, graph), node.size[0] - 2 * PADDING, (text) => ctx.measureText(text).width);
}

// Put the server's verdicts and notes on the node they name.
export function onLevels(event) {
  const detail = event?.detail;
  // The server sends the id as a string; litegraph keys nodes by number (ids inside subgraphs stay strings).
  const node = app.graph?.getNodeById?.(detail?.node) ?? app.graph?.getNodeById?.(Number(detail?.node));
  if (!node || !Array.isArray(detail.lines)) return;
  node.tomeMessage = {
    lines: detail.lines.map(String),
    notes: Array.isArray(detail.notes) ? detail.notes.map(String) : [],
    verdicts: Array.isArray(detail.verdicts) ? detail.verdicts : [],
  };
  node.setDirtyCanvas?.(true, false);
}

export const extension = {
  name: "tome.ToMe.levels",
  async setup() {
    api.addEventListener(LEVELS_EVENT, onLevels);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_IDS.includes(nodeData?.name)) return;
    nodeType.prototype.tomeNodeId = nodeData.name;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      offerModelDefault(this);
      return result;
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const info = message?.tome?.[0];
      if (info && typeof info === "object") {
        this.tomeLastRun = { ...info, base_downsample: Number(info.base_downsample) || 1,
                             ratio: Number(info.ratio) || 0, mode: String(info.mode ?? "merge"),
                             defaults: Array.isArray(info.defaults) ? info.defaults.map(String) : [] };
        this.tomeMessage = undefined;  // a new patch: its verdicts are decided again
      }
      this.setDirtyCanvas?.(true, false);
    };
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      onDrawForeground?.apply(this, arguments);
      if (this.flags?.collapsed) return;
      ctx.save();
      ctx.font = FONT;
      const lines = drawnLines(this, ctx, this.graph ?? app.graph);
      const top = (this.computeSize?.()[1] ?? this.size[1]) - 4;
      const needed = top + lines.length * LINE_HEIGHT + 6;
      if (Math.abs(this.size[1] - needed) > 0.5) this.size[1] = needed;  // fits the lines: no gap, no overflow
      ctx.fillStyle = "#9ab";
      ctx.textAlign = "left";
      lines.forEach((line, i) => ctx.fillText(line, PADDING, top + (i + 1) * LINE_HEIGHT));
      ctx.restore();
    };
  },
};

app.registerExtension(extension);
