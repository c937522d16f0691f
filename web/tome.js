// ComfyUI frontend extension for tome's ToMe nodes: draws on the node the token reduction per
// UNet level for the latent size the node's model is sampled at. Canvas text only (no HTML is
// built), no network calls; values come from the node's widgets, the graph and the last run.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { NODE_IDS, WANVIDEO_NODE_ID, describeLevels } from "./tome_levels.js";

// Sent by the server (nodes/ui_messages.py) when the speed check decides a level during sampling.
export const LEVELS_EVENT = "tome.levels";

const LINE_HEIGHT = 14;
const MAX_HOPS = 12;
const SETTINGS = ["ratio", "max_downsample", "sx", "sy", "mode", "min_tokens", "start_percent", "end_percent"];

function linkById(graph, id) {
  const links = graph?.links;
  if (!links) return undefined;
  return typeof links.get === "function" ? links.get(id) : links[id];
}

function widgetValue(node, name) {
  const widget = node?.widgets?.find((w) => w.name === name);
  return widget ? widget.value : undefined;
}

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

// How mode merge's attention weighs the merged keys (tome_core.engine.token_merge.ATTENTION_WORDS); plain: no line.
const ATTENTION_LINES = {
  balanced: "balanced attention: the merged image keys weigh as the image's tokens against the text",
  proportional: "proportional attention: each merged key weighs as the tokens it holds",
};

// A DiT (Flux, SD3, Wan, HunyuanVideo) has no UNet levels: the last run's kv window on its image/video tokens,
// or (mode merge) the share of image tokens carried merged through its blocks. ``notes``: what the run sent
// (nodes/ui_messages.py); "balanced attention needs a mask; ...: plain" replaces the attention line.
export function ditLines(lastRun, notes = []) {
  const weighed = ATTENTION_LINES[lastRun.merge_attention]
    && !notes.some((line) => line.startsWith(`${lastRun.merge_attention} attention needs a mask;`));
  const window = lastRun.kv_window ?? [];
  const kept = window.reduce((a, b) => a * b, 1);
  const merged = Math.round((lastRun.ratio ?? 0) * 100);
  const lines = lastRun.mode === "merge" ? [
    `${lastRun.model_type} (${lastRun.family}): mode merge on image tokens`,
    merged > 0 ? `${merged}% of the image tokens merged into a similar neighbour through each block; text kept`
               : "ratio 0: nothing reduced",
    ...(merged > 0 && weighed ? [ATTENTION_LINES[lastRun.merge_attention]] : []),
  ] : [
    `${lastRun.model_type} (${lastRun.family}): mode kv on image tokens`,
    kept > 1 ? `keys/values: 1 of ${kept} per ${window.join("x")} window; every query and text token kept`
             : "ratio too low for a window: nothing reduced",
  ];
  const [reduced, total] = lastRun.blocks ?? [];
  if (total > 0) lines.push(reduced === total ? `all ${total} blocks` : `blocks reduced: ${reduced} of ${total}`);
  if (lastRun.quality) lines.push(lastRun.quality);  // the family's default and a higher ratio against tomesd's error
  return lines;
}

export function infoLines(node, graph) {
  const settings = {};
  for (const name of SETTINGS) {
    const value = widgetValue(node, name);
    if (value !== undefined) settings[name] = value;
  }
  const lastRun = node.tomeLastRun;
  // a DiT: the run's notes (mode merge) or verdicts (WanVideoWrapper) after its plan
  if (lastRun?.family) return [...ditLines(lastRun, node.tomeLevels), ...(node.tomeLevels ?? [])];
  if (node.tomeNodeId === WANVIDEO_NODE_ID) {  // a WanVideoWrapper model: no UNet levels to draw before the run
    const ratio = settings.ratio === undefined || settings.ratio < 0 ? "Wan's default" : settings.ratio;
    return [`WanVideoWrapper: mode ${settings.mode ?? "merge"}, ratio ${ratio}; the plan is shown after the node runs`];
  }
  const base = lastRun?.base_downsample ?? 1;
  const size = findLatentSize(node, graph);
  const width = size?.width ?? 512;
  const height = size?.height ?? 512;
  const head = [
    `${width}x${height}${size ? "" : " (no latent found, assumed)"}`,
    lastRun ? `${lastRun.model_type}: first attention level ${base}x` : "first attention level 1x (SDXL: 2x)",
  ];
  return [head.join(", "), ...describeLevels(width, height, settings, base), ...speedCheckLines(node)];
}

// What the speed check decided on this GPU in the last run (the engine's own words), or how it will decide.
export function speedCheckLines(node) {
  const check = widgetValue(node, "speed_check") ?? node.tomeLastRun?.speed_check ?? "auto";
  if (check === "off") return [];
  const decided = (node.tomeLevels ?? []).filter((line) => line.startsWith("level "));
  return decided.length ? decided : [`speed check ${check}: levels are timed at the first step (shown here after the run)`];
}

// Put the server's verdict lines on the node they name.
export function onLevels(event) {
  const detail = event?.detail;
  // The server sends the id as a string; litegraph keys nodes by number (ids inside subgraphs stay strings).
  const node = app.graph?.getNodeById?.(detail?.node) ?? app.graph?.getNodeById?.(Number(detail?.node));
  if (!node || !Array.isArray(detail.lines)) return;
  node.tomeLevels = detail.lines.map(String);
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
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const info = message?.tome?.[0];
      if (info && typeof info === "object") {
        this.tomeLastRun = { base_downsample: Number(info.base_downsample) || 1, model_type: String(info.model_type),
                             speed_check: String(info.speed_check ?? "off") };
        this.tomeLevels = undefined;  // a new patch: its levels are decided again
        if (info.family) {
          this.tomeLastRun.family = String(info.family);
          this.tomeLastRun.kv_window = Array.isArray(info.kv_window) ? info.kv_window.map(Number) : [];
          this.tomeLastRun.mode = String(info.mode ?? "kv");
          this.tomeLastRun.ratio = Number(info.ratio) || 0;
          if (info.merge_attention) this.tomeLastRun.merge_attention = String(info.merge_attention);
          if (Array.isArray(info.blocks)) this.tomeLastRun.blocks = info.blocks.map(Number);
          if (info.quality) this.tomeLastRun.quality = String(info.quality);
        }
      }
      this.setDirtyCanvas?.(true, false);
    };
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      onDrawForeground?.apply(this, arguments);
      if (this.flags?.collapsed) return;
      const lines = infoLines(this, this.graph ?? app.graph);
      const top = (this.computeSize?.()[1] ?? this.size[1]) - 4;
      const needed = top + lines.length * LINE_HEIGHT + 6;
      if (this.size[1] < needed) this.size[1] = needed;
      ctx.save();
      ctx.font = "11px sans-serif";
      ctx.fillStyle = "#9ab";
      ctx.textAlign = "left";
      lines.forEach((line, i) => ctx.fillText(line, 10, top + (i + 1) * LINE_HEIGHT));
      ctx.restore();
    };
  },
};

app.registerExtension(extension);
