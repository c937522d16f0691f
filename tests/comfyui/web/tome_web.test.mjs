// Load-tests web/ in Node: the extension module is imported as ComfyUI serves it
// (/extensions/<package>/tome.js next to /scripts/app.js, here a recording stand-in), registers
// itself, and draws the per-level token counts of a small graph onto a recording canvas context.
import { test } from "node:test";
import assert from "node:assert/strict";
import { cpSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const WEB = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "web");

async function loadExtension() {
  const root = mkdtempSync(join(tmpdir(), "tome-web-"));
  mkdirSync(join(root, "scripts"));
  writeFileSync(join(root, "scripts", "app.js"),
    "export const app = { extensions: [], graph: null, registerExtension(e) { this.extensions.push(e); } };\n");
  // ComfyUI's api (scripts/api.js) is an EventTarget that re-dispatches the server's websocket messages.
  writeFileSync(join(root, "scripts", "api.js"), "export const api = new EventTarget();\n");
  cpSync(WEB, join(root, "extensions", "tome-diffusion"), { recursive: true });
  const module = await import(pathToFileURL(join(root, "extensions", "tome-diffusion", "tome.js")));
  const { app } = await import(pathToFileURL(join(root, "scripts", "app.js")));
  const { api } = await import(pathToFileURL(join(root, "scripts", "api.js")));
  return { module, app, api };
}

function makeGraph() {
  const nodes = new Map();
  const links = new Map();
  const graph = { links, getNodeById: (id) => nodes.get(id) };
  const add = (node) => { nodes.set(node.id, node); return node; };
  const link = (id, origin, target) => links.set(id, { id, origin_id: origin, target_id: target });
  add({ id: 2, widgets: [{ name: "width", value: 1024 }, { name: "height", value: 768 }], outputs: [] });
  add({ id: 3, inputs: [{ name: "model", link: 10 }, { name: "latent_image", link: 11 }], outputs: [] });
  link(10, 1, 3);
  link(11, 2, 3);
  return { graph, add };
}

test("web files make no network calls and build no HTML", () => {
  for (const name of readdirSync(WEB).filter((entry) => entry.endsWith(".js"))) {
    const source = readFileSync(join(WEB, name), "utf8");
    for (const banned of ["fetch(", "XMLHttpRequest", "WebSocket", "innerHTML", "outerHTML", "insertAdjacentHTML",
      "document.write", "api.fetchApi"]) {
      assert.ok(!source.includes(banned), `${name} uses ${banned}`);
    }
  }
});

// A recording canvas context: each fillText, and a measureText of 6 px per character (wrapping is tested on it).
function recordingContext(drawn) {
  return { save() {}, restore() {}, fillText: (text) => drawn.push(text), measureText: (text) => ({ width: 6 * text.length }) };
}

test("the extension registers and draws per-level token counts, wrapped to the node", async () => {
  const { module, app } = await loadExtension();
  assert.equal(app.extensions.length, 1);
  const extension = app.extensions[0];
  assert.equal(extension, module.extension);

  class NodeType {}
  await extension.beforeRegisterNodeDef(NodeType, { name: "KSampler" });
  assert.equal(NodeType.prototype.onDrawForeground, undefined, "other nodes are left alone");
  await extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMe" });

  const { graph, add } = makeGraph();
  const node = add(Object.assign(new NodeType(), {
    id: 1, graph, size: [300, 80], computeSize: () => [300, 80],
    widgets: [{ name: "ratio", value: 0.5 }, { name: "max_downsample", value: 1 }],
    outputs: [{ name: "MODEL", type: "MODEL", links: [10] }],
  }));
  const logical = module.infoLines(node, graph);
  assert.deepEqual(logical.slice(0, 3), ["1024x768 px", "merge 0.5 (levels as on SD1.5)",
                                         "level 1 · 128x96 tokens: 12288 → 6144 (-50%)"]);
  assert.equal(logical[3], "level 2 · 64x48 tokens: 3072, unchanged");
  const drawn = [];
  node.onDrawForeground(recordingContext(drawn));
  assert.ok(drawn.every((line) => 6 * line.length <= 300 - 2 * module.PADDING), "every line fits the node");
  assert.equal(drawn.join(" "), logical.join(" "), "wrapped, not cut");
  assert.ok(drawn.length > logical.length, "the long lines were wrapped");
  assert.equal(node.size[1], 80 - 4 + drawn.length * module.LINE_HEIGHT + 6, "the node fits its lines exactly");

  node.onExecuted({ tome: [{ base_downsample: 2, model_type: "SDXL", name: "SDXL", mode: "merge", ratio: 0.5,
                             defaults: ["ratio"], default_ratio: 0.5 }] });
  const after = module.infoLines(node, graph);
  assert.equal(after[0], "SDXL · merge 0.5 (model default) · 1024x768 px");
  assert.equal(after[1], "level 1 · 64x48 tokens: 3072 → 1536 (-50%)", "SDXL's first attention level is 2x");
});

test("-1 is the model's default: shown in words, and one step leaves it for a valid value", async () => {
  const { module } = await loadExtension();
  class NodeType {}
  await module.extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMeAdvanced" });
  const calls = [];
  // the shape of ComfyUI's number widget (frontend 1.x NumberWidget): _displayValue on its prototype
  class NumberWidget {
    constructor(name, value) { Object.assign(this, { name, value, options: { precision: 2 } }); }
    get _displayValue() { return Number(this.value).toFixed(2); }
  }
  const ratio = Object.assign(new NumberWidget("ratio", -1), { callback(v) { calls.push(["ratio", v, this.value]); } });
  const start = new NumberWidget("block_start", -1);
  const mode = { name: "mode", value: "merge" };
  const node = Object.assign(new NodeType(), { id: 3, widgets: [ratio, mode, start], outputs: [] });
  node.onNodeCreated();
  assert.equal(ratio._displayValue, "model default");
  assert.equal(start._displayValue, "model default");
  // an arrow click from -1: the frontend sets -0.99 then calls the callback
  ratio.value = -0.99;
  ratio.callback(-0.99);
  assert.equal(ratio.value, 0.5, "tomesd's 0.5 before a run tells the model's own");
  assert.deepEqual(calls.at(-1), ["ratio", 0.5, 0.5], "the frontend's own callback sees the snapped value");
  assert.equal(ratio._displayValue, "0.50");
  ratio.value = -0.01;  // one step down from 0
  ratio.callback(-0.01);
  assert.equal(ratio.value, -1);
  start.value = -0.99;
  start.callback(-0.99);
  assert.equal(start.value, 0, "block_start leaves its default for the first block");
  // after a run at the model's default, the widget says which default, and a step starts from it
  node.onExecuted({ tome: [{ model_type: "Flux", name: "Flux", family: "flux", mode: "merge", ratio: 0.2,
                             defaults: ["ratio", "block_start"], default_ratio: 0.2, blocks: [38, 57] }] });
  ratio.value = -1;
  assert.equal(ratio._displayValue, "merge 0.2 (Flux default)");
  mode.value = "kv";
  assert.equal(ratio._displayValue, "model default", "another mode: its default is not the run's");
  ratio.value = -0.99;
  ratio.callback(-0.99);
  assert.equal(ratio.value, 0.2);
  assert.equal(module.snapDefault(0.3, 0.5), 0.3);
  assert.equal(module.snapDefault(-1, 0.5), -1);
});

test("a frontend without _displayValue (the 2024 one) labels the widget", async () => {
  const { module } = await loadExtension();
  const widget = { name: "ratio", value: -1 };
  module.offerModelDefault({ widgets: [widget] });
  assert.equal(widget.label, "ratio (-1 = model default)");
});

test("wrapLines keeps words whole and cuts only a word wider than the line", async () => {
  const { module } = await loadExtension();
  const measure = (text) => text.length;
  assert.deepEqual(module.wrapLines(["aaa bbb ccc", "dd"], 7, measure), ["aaa bbb", "ccc", "dd"]);
  assert.deepEqual(module.wrapLines(["abcdefghij"], 4, measure), ["abcd", "efgh", "ij"]);
});

test("without a sampler downstream a 512x512 latent is assumed, and the default ratio is said", async () => {
  const { module } = await loadExtension();
  const node = { id: 7, widgets: [{ name: "mode", value: "kv" }, { name: "ratio", value: 0.75 }], outputs: [] };
  const lines = module.infoLines(node, { links: {}, getNodeById: () => undefined });
  assert.equal(lines[0], "512x512 px (assumed: no sampler's latent found)");
  assert.equal(lines[2], "level 1 · 64x64 tokens: keys/values 4096 → 1024 (-75%), every query kept");
  node.widgets[1].value = -1;
  assert.match(module.infoLines(node, { links: {}, getNodeById: () => undefined })[1], /^ratio: model default/);
});

test("after a DiT run the node shows the model, setting, window and blocks", async () => {
  const { module } = await loadExtension();
  class NodeType {}
  await module.extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMe" });
  const node = Object.assign(new NodeType(), { id: 5, widgets: [{ name: "ratio", value: 0.75 }], outputs: [] });
  const empty = { links: {}, getNodeById: () => undefined };
  node.onExecuted({ tome: [{ model_type: "Flux", name: "Flux", family: "flux", mode: "kv", ratio: 0.75,
                             kv_window: [2, 2], speed_check: "auto" }] });
  assert.deepEqual(module.infoLines(node, empty), ["Flux · kv 0.75",
    "keys/values: 1 of 4 per 2x2 window; every query kept", "speed check auto: decided at the first step"]);
  node.onExecuted({ tome: [{ model_type: "WAN21", name: "Wan 2.x", family: "wan", mode: "kv", ratio: 0.1,
                             kv_window: [1, 1] }] });
  assert.equal(module.infoLines(node, empty)[1], "ratio too low for a window: nothing reduced");
  node.onExecuted({ tome: [{ model_type: "Flux", name: "Flux", family: "flux", mode: "kv", ratio: 0.5,
                             kv_window: [1, 2], blocks: [19, 57] }] });
  assert.equal(module.infoLines(node, empty)[2], "blocks reduced: 19 of 57");
  node.onExecuted({ tome: [{ model_type: "Flux", name: "Flux", family: "flux", mode: "merge", ratio: 0.2,
                             defaults: ["ratio"], blocks: [57, 57] }] });
  assert.deepEqual(module.infoLines(node, empty).slice(0, 3), ["Flux · merge 0.2 (model default)",
    "20% of the image tokens merged through each reduced block; text kept", "blocks reduced: all 57"]);
});

test("a run that finds the attention ignores masks replaces the balanced line with what it found", async () => {
  const { module, app } = await loadExtension();
  class NodeType {}
  await module.extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMe" });
  const node = Object.assign(new NodeType(), { id: 4, widgets: [{ name: "ratio", value: 0.5 }], outputs: [] });
  app.graph = { links: {}, getNodeById: (id) => (id === 4 ? node : undefined) };
  node.onExecuted({ tome: [{ model_type: "QwenImage", name: "Qwen-Image", family: "qwen_image", mode: "merge",
                             ratio: 0.5, kv_window: [], blocks: [60, 60], merge_attention: "balanced",
                             speed_check: "off" }] });
  assert.ok(module.infoLines(node, app.graph).some((line) => line.startsWith("balanced attention: ")));
  // what nodes/ui_messages.py sends when the first model call's probe finds the mask ignored
  const note = "balanced attention needs a mask; ComfyUI-KJNodes' PathchSageAttentionKJ.patch.attention_override_sage "
    + "ignores masks: plain";
  module.onLevels({ detail: { node: "4", lines: [note], notes: [note], verdicts: [] } });
  assert.deepEqual(module.infoLines(node, app.graph), ["Qwen-Image · merge 0.5",
    "50% of the image tokens merged through each reduced block; text kept", "blocks reduced: all 60", note,
    "speed check off: always reduced"]);
});

test("the speed check's verdicts sent during sampling are drawn on the node they name, in words", async () => {
  const { module, app, api } = await loadExtension();
  class NodeType {}
  await module.extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMeAdvanced" });
  await module.extension.setup();
  const { graph, add } = makeGraph();
  app.graph = graph;
  const node = add(Object.assign(new NodeType(), {
    id: 1, graph, size: [300, 80], computeSize: () => [300, 80],
    widgets: [{ name: "ratio", value: 0.5 }, { name: "speed_check", value: "auto" }],
    outputs: [{ name: "MODEL", type: "MODEL", links: [10] }],
  }));
  assert.match(module.infoLines(node, graph).at(-1), /^speed check auto: timed at the first step on a GPU/);
  node.onExecuted({ tome: [{ base_downsample: 1, model_type: "BaseModel", name: "SD1.5", mode: "merge", ratio: 0.5,
                             speed_check: "auto" }] });
  assert.equal(module.infoLines(node, graph).at(-1), "speed check auto: decided at the first step");
  // nodes/ui_messages.py message(): the engine's lines, notes and verdict records (Verdict.record)
  const slower = { level: 1, tokens: [96, 128], blocks: 5, pixels: [1024, 768], reduce: false, speedup: 0.86,
                   device: "cuda:0 (NVIDIA H200)", untimed: null, timed: "the model call" };
  const cpu = { level: 2, tokens: [48, 64], blocks: 4, pixels: [1024, 768], reduce: true, speedup: null,
                device: "cpu", untimed: null, timed: "the model call" };
  api.dispatchEvent(new CustomEvent(module.LEVELS_EVENT, { detail: { node: "1", lines: ["ToMe merge r=0.5 ..."],
                                                                     notes: [], verdicts: [slower, cpu] } }));
  assert.deepEqual(module.infoLines(node, graph).slice(-2), [
    "level 1: left whole · ToMe measured 0.86x (slower) on cuda:0 (NVIDIA H200)", "level 2: reduced · not timed: CPU"]);
  api.dispatchEvent(new CustomEvent(module.LEVELS_EVENT, { detail: { node: "99", lines: ["elsewhere"] } }));
  assert.equal(module.infoLines(node, graph).at(-1), "level 2: reduced · not timed: CPU", "not another node's");
  assert.equal(module.verdictWords({ reduce: true, speedup: 1.4, device: "cpu", timed: "its self-attention alone" }),
               "reduced · 1.40x faster on CPU (its self-attention alone)");
  assert.equal(module.verdictWords({ reduce: true, speedup: null, device: "cuda:0",
                                     untimed: "cannot repeat the call beside another hook on the model" }),
               "reduced · not timed: cannot repeat the call beside another hook on the model");
  node.onExecuted({ tome: [{ base_downsample: 1, model_type: "BaseModel", name: "SD1.5", speed_check: "auto" }] });
  assert.match(module.infoLines(node, graph).at(-1), /^speed check auto: decided/, "a new run decides again");
  node.widgets[1].value = "off";
  assert.equal(module.infoLines(node, graph).at(-1), "speed check off: always reduced");
});

test("the WanVideoWrapper node draws its mode before a run and the plan after it", async () => {
  const { module } = await loadExtension();
  class NodeType {}
  await module.extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMeWanVideo" });
  const node = Object.assign(new NodeType(), { id: 8, outputs: [{ name: "model", type: "WANVIDEOMODEL", links: [] }],
    widgets: [{ name: "ratio", value: 0.5 }, { name: "mode", value: "kv" }] });
  const empty = { links: {}, getNodeById: () => undefined };
  assert.deepEqual(module.infoLines(node, empty),
    ["WanVideoWrapper · mode kv, ratio 0.5; the plan is shown after the run"]);
  node.widgets[0].value = -1;
  assert.deepEqual(module.infoLines(node, empty),
    ["WanVideoWrapper · mode kv, ratio model default; the plan is shown after the run"]);
  node.onExecuted({ tome: [{ model_type: "ComfyUI-WanVideoWrapper WanModel", name: "Wan 2.x", family: "wan",
                             mode: "kv", ratio: 0.5, kv_window: [1, 1, 2], blocks: [30, 30], speed_check: "auto" }] });
  assert.deepEqual(module.infoLines(node, empty).slice(0, 3), ["Wan 2.x · kv 0.5",
    "keys/values: 1 of 2 per 1x1x2 window; every query kept", "blocks reduced: all 30"]);
  node.tomeMessage = { notes: [], verdicts: [{ call: "21x30x52 video tokens, batch 1", reduce: true, speedup: 1.17,
                                               device: "cuda:0 (NVIDIA H200)", timed: "the model call" }] };
  assert.equal(module.infoLines(node, empty).at(-1),
               "21x30x52 video tokens, batch 1: reduced · 1.17x faster on cuda:0 (NVIDIA H200)");
});

test("a transformer's run draws its family's quality line; ratio -1 draws a UNet's levels at tomesd's 0.5", async () => {
  const { module } = await loadExtension();
  const quality = "Wan: default merge 0.5 (0.2x tomesd's error); merge 0.625: 0.25x";
  const lines = module.ditLines({ model_type: "WAN21", family: "wan", mode: "merge", ratio: 0.5, blocks: [2, 2],
                                  quality });
  assert.equal(lines.at(-1), quality);
  const levels = await import(pathToFileURL(join(WEB, "tome_levels.js")));
  assert.deepEqual(levels.tokenLevels(512, 512, { ratio: -1 }), levels.tokenLevels(512, 512, { ratio: 0.5 }));
});
