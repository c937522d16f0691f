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
  for (const name of readdirSync(WEB)) {
    const source = readFileSync(join(WEB, name), "utf8");
    for (const banned of ["fetch(", "XMLHttpRequest", "WebSocket", "innerHTML", "outerHTML", "insertAdjacentHTML",
      "document.write", "api.fetchApi"]) {
      assert.ok(!source.includes(banned), `${name} uses ${banned}`);
    }
  }
});

test("the extension registers and draws per-level token counts", async () => {
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
  const drawn = [];
  const ctx = { save() {}, restore() {}, fillText: (text) => drawn.push(text) };
  node.onDrawForeground(ctx);
  assert.match(drawn[0], /^1024x768, first attention level 1x/);
  assert.equal(drawn[1], "1x 128x96: 12288 -> 6144 tokens (-50%)");
  assert.equal(drawn[2], "2x 64x48: 3072 tokens, unchanged");
  assert.ok(node.size[1] >= 80 + drawn.length * 14, "the node grows to fit the text");

  node.onExecuted({ tome: [{ base_downsample: 2, model_type: "SDXL" }] });
  drawn.length = 0;
  node.onDrawForeground(ctx);
  assert.match(drawn[0], /SDXL: first attention level 2x/);
  assert.equal(drawn[1], "2x 64x48: 3072 -> 1536 tokens (-50%)");
});

test("without a sampler downstream a 512x512 latent is assumed", async () => {
  const { module } = await loadExtension();
  const node = { id: 7, widgets: [{ name: "mode", value: "kv" }, { name: "ratio", value: 0.75 }], outputs: [] };
  const lines = module.infoLines(node, { links: {}, getNodeById: () => undefined });
  assert.match(lines[0], /512x512 \(no latent found, assumed\)/);
  assert.equal(lines[1], "1x 64x64: 4096 queries, keys/values 4096 -> 1024 (-75%)");
});

test("after a DiT run the node shows the kv window instead of UNet levels", async () => {
  const { module } = await loadExtension();
  class NodeType {}
  await module.extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMe" });
  const node = Object.assign(new NodeType(), { id: 5, widgets: [{ name: "ratio", value: 0.75 }], outputs: [] });
  node.onExecuted({ tome: [{ base_downsample: 1, model_type: "Flux", family: "flux", kv_window: [2, 2] }] });
  const lines = module.infoLines(node, { links: {}, getNodeById: () => undefined });
  assert.deepEqual(lines, ["Flux (flux): mode kv on image tokens",
    "keys/values: 1 of 4 per 2x2 window; every query and text token kept"]);
  node.onExecuted({ tome: [{ base_downsample: 1, model_type: "WAN21", family: "wan", kv_window: [1, 1] }] });
  assert.equal(module.infoLines(node, { links: {}, getNodeById: () => undefined })[1],
    "ratio too low for a window: nothing reduced");
  node.onExecuted({ tome: [{ model_type: "Flux", family: "flux", kv_window: [1, 2], blocks: [19, 57] }] });
  assert.equal(module.infoLines(node, { links: {}, getNodeById: () => undefined })[2], "blocks reduced: 19 of 57");
  node.onExecuted({ tome: [{ model_type: "Flux", family: "flux", kv_window: [1, 2], blocks: [57, 57] }] });
  assert.equal(module.infoLines(node, { links: {}, getNodeById: () => undefined })[2], "all 57 blocks");
});

test("after a DiT run in mode merge the node shows the merged share of image tokens", async () => {
  const { module } = await loadExtension();
  class NodeType {}
  await module.extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMe" });
  const node = Object.assign(new NodeType(), { id: 6, widgets: [{ name: "ratio", value: 0.5 }], outputs: [] });
  node.onExecuted({ tome: [{ model_type: "QwenImage", family: "qwen_image", mode: "merge", ratio: 0.5, kv_window: [],
                             blocks: [60, 60], merge_attention: "plain" }] });
  assert.deepEqual(module.infoLines(node, { links: {}, getNodeById: () => undefined }), [
    "QwenImage (qwen_image): mode merge on image tokens",
    "50% of the image tokens merged into a similar neighbour through each block; text kept", "all 60 blocks"]);
  node.onExecuted({ tome: [{ model_type: "QwenImage", family: "qwen_image", mode: "merge", ratio: 0.5, kv_window: [],
                             blocks: [60, 60], merge_attention: "balanced" }] });
  assert.equal(module.infoLines(node, { links: {}, getNodeById: () => undefined })[2],
               "balanced attention: the merged image keys weigh as the image's tokens against the text");
  node.onExecuted({ tome: [{ model_type: "QwenImage", family: "qwen_image", mode: "merge", ratio: 0, kv_window: [] }] });
  assert.equal(module.infoLines(node, { links: {}, getNodeById: () => undefined })[1], "ratio 0: nothing reduced");
});

test("a run that finds the attention ignores masks replaces the balanced line with what it found", async () => {
  const { module, app } = await loadExtension();
  class NodeType {}
  await module.extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMe" });
  const node = Object.assign(new NodeType(), { id: 4, widgets: [{ name: "ratio", value: 0.5 }], outputs: [] });
  app.graph = { links: {}, getNodeById: (id) => (id === 4 ? node : undefined) };
  node.onExecuted({ tome: [{ model_type: "QwenImage", family: "qwen_image", mode: "merge", ratio: 0.5, kv_window: [],
                             blocks: [60, 60], merge_attention: "balanced" }] });
  assert.ok(module.infoLines(node, app.graph).some((line) => line.startsWith("balanced attention: ")));
  // what nodes/ui_messages.py announce_notes sends when the first model call's probe finds the mask ignored
  const note = "balanced attention needs a mask; ComfyUI-KJNodes' PathchSageAttentionKJ.patch.attention_override_sage "
    + "ignores masks: plain";
  module.onLevels({ detail: { node: "4", lines: [note] } });
  assert.deepEqual(module.infoLines(node, app.graph), ["QwenImage (qwen_image): mode merge on image tokens",
    "50% of the image tokens merged into a similar neighbour through each block; text kept", "all 60 blocks", note]);
});

test("the speed check's verdicts sent during sampling are drawn on the node they name", async () => {
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
  node.onExecuted({ tome: [{ base_downsample: 1, model_type: "BaseModel", speed_check: "auto" }] });
  let lines = module.infoLines(node, graph);
  assert.equal(lines.at(-1), "speed check auto: levels are timed at the first step (shown here after the run)");
  const verdict = "level 1 (96x128 tokens, 5 blocks) at 1024x768 px: left whole: merging measured 0.86x on cuda:0 (NVIDIA H200)";
  api.dispatchEvent(new CustomEvent(module.LEVELS_EVENT, { detail: { node: "1", lines: ["ToMe merge r=0.5 ...", verdict] } }));
  assert.deepEqual(node.tomeLevels, ["ToMe merge r=0.5 ...", verdict]);
  lines = module.infoLines(node, graph);
  assert.equal(lines.at(-1), verdict);
  api.dispatchEvent(new CustomEvent(module.LEVELS_EVENT, { detail: { node: "99", lines: ["elsewhere"] } }));
  assert.equal(module.infoLines(node, graph).at(-1), verdict, "another node's verdicts are not drawn here");
  node.onExecuted({ tome: [{ base_downsample: 1, model_type: "BaseModel", speed_check: "auto" }] });
  assert.match(module.infoLines(node, graph).at(-1), /^speed check auto/, "a new run decides again");
  node.widgets[1].value = "off";
  assert.ok(!module.infoLines(node, graph).some((line) => line.includes("speed check")));
});

test("the WanVideoWrapper node draws its mode before a run and the plan after it", async () => {
  const { module } = await loadExtension();
  class NodeType {}
  await module.extension.beforeRegisterNodeDef(NodeType, { name: "TomeCoreToMeWanVideo" });
  const node = Object.assign(new NodeType(), { id: 8, outputs: [{ name: "model", type: "WANVIDEOMODEL", links: [] }],
    widgets: [{ name: "ratio", value: 0.5 }, { name: "mode", value: "kv" }] });
  const empty = { links: {}, getNodeById: () => undefined };
  assert.deepEqual(module.infoLines(node, empty),
    ["WanVideoWrapper: mode kv, ratio 0.5; the plan is shown after the node runs"]);
  node.widgets[0].value = -1;  // the widget's "the model's default"
  assert.deepEqual(module.infoLines(node, empty),
    ["WanVideoWrapper: mode kv, ratio Wan's default; the plan is shown after the node runs"]);
  node.widgets[0].value = 0.5;
  node.onExecuted({ tome: [{ model_type: "ComfyUI-WanVideoWrapper WanModel", family: "wan", mode: "kv", ratio: 0.5,
                             kv_window: [1, 1, 2], blocks: [30, 30] }] });
  assert.deepEqual(module.infoLines(node, empty), ["ComfyUI-WanVideoWrapper WanModel (wan): mode kv on image tokens",
    "keys/values: 1 of 2 per 1x1x2 window; every query and text token kept", "all 30 blocks"]);
  const verdict = "21x30x52 video tokens, batch 1: reduced: the model call with kv measured 1.17x on cuda:0 (NVIDIA H200)";
  node.tomeLevels = [verdict];  // what onLevels puts there when the server sends the verdict (tome.levels)
  assert.equal(module.infoLines(node, empty).at(-1), verdict);
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
