// Token counts per UNet attention level for a ToMe setting: a mirror of tome_core's planning
// (tome_core/plan.py, merge.py, levels.py) for display only. Pure functions, no DOM, no network.

export const WANVIDEO_NODE_ID = "TomeCoreToMeWanVideo";  // registered only beside ComfyUI-WanVideoWrapper
export const NODE_IDS = ["TomeCoreToMe", "TomeCoreToMeAdvanced", WANVIDEO_NODE_ID];

export const DEFAULTS = Object.freeze({
  ratio: 0.5, max_downsample: 1, sx: 2, sy: 2, mode: "merge", min_tokens: 0,
  start_percent: 0, end_percent: 1, merge_crossattn: false, use_rand: true,
});

// The (py, px) key/value pooling window of mode "kv" (tome_core.merge.kv_pool_window): the area
// closest in log scale to 1 / (1 - ratio); ties go to the smaller area, then the squarer window.
export function kvPoolWindow(ratio, sx, sy) {
  const target = Math.log(1 / (1 - ratio));
  const key = ([py, px]) => [Math.round(Math.abs(Math.log(py * px) - target) * 1e9), py * px, Math.abs(py - px), -px];
  let best = [1, 1];
  for (let py = 1; py <= sy; py++) {
    for (let px = 1; px <= sx; px++) {
      const [ka, kb] = [key([py, px]), key(best)];
      const i = ka.findIndex((v, j) => v !== kb[j]);
      if (i >= 0 && ka[i] < kb[i]) best = [py, px];
    }
  }
  return best;
}

// One row per attention level, from the model's first attention level (baseDownsample) to 8x.
// width/height: image size in pixels (latent = /8); settings: the node's widget values.
// A ratio (or block_start) of -1 is the widget's "model default" (nodes/tome_nodes.py MODEL_DEFAULT): tomesd's 0.5
// on a UNet, which is what a UNet's levels are drawn at before a run tells the model.
export const MODEL_DEFAULT = -1;
export function tokenLevels(width, height, settings, baseDownsample = 1) {
  const s = { ...DEFAULTS, ...settings };
  if (s.ratio === MODEL_DEFAULT) s.ratio = DEFAULTS.ratio;
  const latentH = Math.ceil(height / 8);
  const latentW = Math.ceil(width / 8);
  const rows = [];
  for (let downsample = baseDownsample; downsample <= 8; downsample *= 2) {
    const h = Math.ceil(latentH / downsample);
    const w = Math.ceil(latentW / downsample);
    const tokens = h * w;
    let kept = tokens;
    let keys = tokens;
    const selected = downsample <= s.max_downsample * baseDownsample && tokens >= s.min_tokens && s.ratio > 0;
    if (selected && s.mode === "kv") {
      const [py, px] = kvPoolWindow(s.ratio, s.sx, s.sy);
      keys = Math.ceil(h / py) * Math.ceil(w / px);
    } else if (selected) {
      const sources = tokens - Math.floor(h / s.sy) * Math.floor(w / s.sx);
      kept = tokens - Math.max(0, Math.min(Math.floor(tokens * s.ratio), sources));
      keys = kept;
    }
    rows.push({ downsample, h, w, tokens, kept, keys, active: kept < tokens || keys < tokens });
  }
  return rows;
}

// A level is named by its depth as max_downsample counts it: 1 = the model's first attention level, then 2, 4, 8
// (the engine's verdicts name levels the same way).
export function levelNumber(downsample, baseDownsample = 1) {
  return downsample / baseDownsample;
}

// Short lines for the node's face: one per level, e.g. "level 1 · 64x64 tokens: 4096 → 2048 (-50%)".
export function describeLevels(width, height, settings, baseDownsample = 1) {
  const s = { ...DEFAULTS, ...settings };
  const lines = [];
  for (const row of tokenLevels(width, height, s, baseDownsample)) {
    const name = `level ${levelNumber(row.downsample, baseDownsample)} · ${row.w}x${row.h} tokens`;
    if (!row.active) {
      lines.push(`${name}: ${row.tokens}, unchanged`);
    } else if (s.mode === "kv") {
      const cut = Math.round(100 * (1 - row.keys / row.tokens));
      lines.push(`${name}: keys/values ${row.tokens} → ${row.keys} (-${cut}%), every query kept`);
    } else {
      const cut = Math.round(100 * (1 - row.kept / row.tokens));
      lines.push(`${name}: ${row.tokens} → ${row.kept} (-${cut}%)`);
    }
  }
  if (s.start_percent > 0 || s.end_percent < 1) {
    lines.push(`on from ${Math.round(s.start_percent * 100)}% to ${Math.round(s.end_percent * 100)}% of sampling`);
  }
  return lines;
}
