// omnistage playground, the Duplex tab: a full-duplex session on /v1/duplex (docs/duplex.md).
// The microphone goes up as PCM16 at the model's rate (24 kHz), about one append a tick; the
// model's frames are played back to back as they come, its inner monologue shown as it
// streams, the session's counters kept live. Stop sends session.close; the server answers
// session.ended with the session's stats and closes the socket.
//
// Loaded before playground.js, whose helpers ($, state, apiKey, Microphone, PcmPlayer,
// bytesToB64, status, fail) these functions call only once the page has started.
"use strict";

const DX_CLOSE_WAIT_MS = 3000;     // a session.close unanswered this long: the socket is closed
const DX_TRANSCRIPT_CHARS = 4000;  // the monologue shown: its latest characters
const DX_PLAYBACK_LEAD_S = 0.15;   // jitter buffer: a frame comes every tick, give or take

const dx = { ws: null, mic: null, player: null, live: false, ended: false, lastError: "",
             closeTimer: null, rate: 24000, frameSamples: 1920, pending: [], numPending: 0,
             counts: null };

function dxSend(event) {
  if (dx.ws && dx.ws.readyState === WebSocket.OPEN) dx.ws.send(JSON.stringify(event));
}

function dxState(text) { $("dx-state").textContent = text; }

function dxNewCounts() {
  return { ticks: 0, frames: 0, missedTicks: 0, missedInputs: 0, latencyMs: null,
           latencyMaxMs: 0, sentSamples: 0 };
}

function dxShowCounts() {
  const c = dx.counts;
  $("dx-ticks").value = String(c.ticks);
  $("dx-frames").value = String(c.frames);
  $("dx-missed-ticks").value = String(c.missedTicks);
  $("dx-missed-inputs").value = String(c.missedInputs);
  $("dx-latency").value = c.latencyMs === null ? "–"
    : `${c.latencyMs.toFixed(1)} ms (max ${c.latencyMaxMs.toFixed(1)})`;
  $("dx-sent").value = `${(c.sentSamples / dx.rate).toFixed(1)} s`;
}

// ---- the session ---------------------------------------------------------------------------

function dxStart() {
  // resume_grace_s=0: the page does not resume, so a socket that drops frees its slot at once
  const query = `model=${encodeURIComponent(state.model)}&resume_grace_s=0`;
  const url = new URL(`/v1/duplex?${query}`, location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  // a browser's WebSocket sends no headers: the key rides as a subprotocol, as with OpenAI's
  const protocols = apiKey() ? ["realtime", `openai-insecure-api-key.${apiKey()}`] : [];
  Object.assign(dx, { live: false, ended: false, lastError: "", pending: [], numPending: 0,
                      counts: dxNewCounts() });
  $("dx-transcript").textContent = "";
  $("dx-summary").textContent = "";
  dxShowCounts();
  $("dx-start").disabled = true;
  dxState("connecting…");
  dx.ws = new WebSocket(url, protocols);
  dx.ws.onmessage = (e) => dxEvent(JSON.parse(e.data));
  dx.ws.onclose = (e) => dxClosed(e);
}

async function dxCreated(ev) {
  dx.rate = ev.session.audio.input.format.rate;
  dx.frameSamples = ev.session.duplex.frame_samples;
  dx.player.rate = ev.session.audio.output.format.rate;
  dx.live = true;
  $("dx-stop").disabled = false;
  dxState("starting the microphone…");
  const mic = new Microphone(dxHear, dx.rate);
  dx.mic = mic;
  try {
    await mic.start();
  } catch (err) {
    fail(err);
    dxStop();
    return;
  }
  if (dx.live && dx.mic === mic) return dxState("live: speak any time");
  mic.stop();           // stopped while the browser was still opening the microphone
}

// the microphone's pieces gathered to about a frame, then sent: one append a tick or so
function dxHear(pcm) {
  if (!dx.live) return;
  dx.pending.push(pcm);
  dx.numPending += pcm.length;
  if (dx.numPending < dx.frameSamples) return;
  const all = new Int16Array(dx.numPending);
  let at = 0;
  for (const piece of dx.pending) { all.set(piece, at); at += piece.length; }
  dx.pending = [];
  dx.numPending = 0;
  dxSend({ type: "input_audio_buffer.append", audio: bytesToB64(new Uint8Array(all.buffer)) });
  dx.counts.sentSamples += all.length;
  dxShowCounts();
}

function dxStop() {   // the Stop button: the server ends the session and says so
  if (!dx.ws) return;
  dx.live = false;
  if (dx.mic) dx.mic.stop();
  dx.mic = null;
  dx.player.stop();
  $("dx-stop").disabled = true;
  dxState("stopping…");
  dxSend({ type: "session.close" });
  dx.closeTimer = setTimeout(() => { if (dx.ws) dx.ws.close(1000); }, DX_CLOSE_WAIT_MS);
}

function dxClosed(e) {
  clearTimeout(dx.closeTimer);
  if (!dx.ended) {
    const why = `${e.code}${e.reason ? ": " + e.reason : ""}`;
    status(`duplex session closed (${why})${dx.lastError ? ": " + dx.lastError : ""}`,
           e.code !== 1000 || !!dx.lastError);
    dxState("closed");
  }
  dx.live = false;
  if (dx.mic) dx.mic.stop();
  dx.ws = dx.mic = null;
  $("dx-start").disabled = false;
  $("dx-stop").disabled = true;
}

// ---- what the server sends -----------------------------------------------------------------

function dxEnded(ev) {
  dx.ended = true;
  dx.live = false;
  const s = ev.stats;
  Object.assign(dx.counts, { ticks: s.ticks, missedTicks: s.missed_ticks,
                             missedInputs: s.missed_inputs });
  dxShowCounts();
  $("dx-summary").textContent =
    `${s.ticks} ticks · ${s.missed_ticks} missed ticks · ${s.missed_inputs} missed inputs · ` +
    `tick latency p50 ${s.tick_latency_ms_p50} ms, p99 ${s.tick_latency_ms_p99} ms, ` +
    `max ${s.tick_latency_ms_max} ms`;
  dxState(`ended (${ev.reason})`);
}

function dxText(delta) {
  const box = $("dx-transcript");
  const text = box.textContent + delta;
  box.textContent = text.length > DX_TRANSCRIPT_CHARS ? text.slice(-DX_TRANSCRIPT_CHARS) : text;
  box.scrollTop = box.scrollHeight;
}

const DX_HANDLERS = {
  "session.created": (ev) => { dxCreated(ev).catch(fail); },
  "response.output_audio_transcript.delta": (ev) => {
    dx.counts.ticks = ev.tick + 1;
    if (ev.input_missed) dx.counts.missedInputs++;
    if (ev.delta) dxText(ev.delta);
    dxShowCounts();
  },
  "response.output_audio.delta": (ev) => {
    const c = dx.counts;
    c.frames++;
    if (ev.missed_tick) c.missedTicks++;
    c.latencyMs = ev.latency_ms;
    c.latencyMaxMs = Math.max(c.latencyMaxMs, ev.latency_ms);
    if (dx.live) dx.player.push(ev.delta);
    dxShowCounts();
  },
  "session.ended": dxEnded,
  "error": (ev) => {   // a bad event: the session goes on; before session.created: refused
    dx.lastError = ev.error ? ev.error.message : "error";
    status(`duplex: ${dx.lastError}`, true);
  },
};

function dxEvent(ev) {
  const handle = DX_HANDLERS[ev.type];
  if (handle) handle(ev);
}

function setupDuplex() {
  dx.player = new PcmPlayer(OUT_RATE, DX_PLAYBACK_LEAD_S);
  $("dx-start").addEventListener("click", async () => {
    if (dx.ws) return;
    await dx.player.unlock();       // from the click: browsers start audio only after one
    status("");
    dxStart();
  });
  $("dx-stop").addEventListener("click", dxStop);
  // leaving the page ends the session at once (its slot is not held until a timeout)
  window.addEventListener("pagehide", () => dxSend({ type: "session.close" }));
}
