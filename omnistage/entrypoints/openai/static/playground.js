// omnistage playground: plain JavaScript, no build step. Every call goes through the same
// OpenAI-compatible API as any client; the tabs follow /v1/models' `capabilities`.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "omnistage.apiKey";
const OUT_RATE = 24000;      // PCM16 the server streams (chat audio, realtime deltas)
const IN_RATE = 16000;       // PCM16 the realtime tab sends, declared in every session.update
                             // (a session that declares none is taken as OpenAI's 24 kHz)
const state = { model: null, outputs: [], caps: null };   // from /v1/models

// ---- the API -----------------------------------------------------------------------------

function apiKey() { return localStorage.getItem(KEY_STORE) || ""; }

function headers(json = true) {
  const h = json ? { "Content-Type": "application/json" } : {};
  if (apiKey()) h.Authorization = `Bearer ${apiKey()}`;
  return h;
}

class APIError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, { method = "GET", body, signal } = {}) {
  const res = await fetch(path, { method, signal, headers: headers(body !== undefined),
                                  body: body === undefined ? undefined : JSON.stringify(body) });
  if (!res.ok) throw await errorOf(res);
  return res;
}

async function errorOf(res) {
  let message = `${res.status} ${res.statusText}`;
  try { message = (await res.json()).error.message || message; } catch (_) { /* not JSON */ }
  return new APIError(res.status, message);
}

// data: lines of a server-sent event stream, parsed, until [DONE]
async function* sseEvents(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function status(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

function fail(err) {
  if (err.name === "AbortError") return status("stopped");
  status(err.message, true);
  if (err.status === 401) $("api-key").focus();
}

// ---- audio ---------------------------------------------------------------------------------

function b64ToBytes(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function bytesToB64(bytes) {
  let bin = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(bin);
}

// PCM16 chunks played back to back as they arrive (a gap only if the network is late);
// `lead`: how far ahead of now a chunk after a gap starts (a jitter buffer)
class PcmPlayer {
  constructor(rate, lead = 0.05) {
    this.rate = rate; this.lead = lead; this.ctx = null; this.next = 0; this.playing = new Set();
  }

  unlock() {   // from a click: browsers start audio only after a gesture
    if (!this.ctx) this.ctx = new AudioContext();
    return this.ctx.resume();
  }

  push(b64) {
    this.unlock();
    const bytes = b64ToBytes(b64);
    const pcm = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
    if (!pcm.length) return;
    const buf = this.ctx.createBuffer(1, pcm.length, this.rate);
    const ch = buf.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) ch[i] = pcm[i] / 32768;
    const src = this.ctx.createBufferSource();
    src.buffer = buf;
    src.connect(this.ctx.destination);
    const at = Math.max(this.next, this.ctx.currentTime + this.lead);
    src.start(at);
    this.next = at + buf.duration;
    this.playing.add(src);
    src.onended = () => this.playing.delete(src);
  }

  stop() {   // barge-in: what is queued goes silent at once
    for (const src of this.playing) src.stop();
    this.playing.clear();
    this.next = 0;
  }
}

// Float32 blocks at `from` Hz -> PCM16 at `to` Hz (averaging each output sample's span: a
// cheap low-pass, enough for speech). The position carries from block to block, so a stream
// of blocks gives `to` samples a second, none lost at the blocks' edges.
class Pcm16Resampler {
  constructor(from, to) { this.ratio = from / to; this.pos = 0; this.tail = new Float32Array(0); }

  push(block) {
    const x = new Float32Array(this.tail.length + block.length);
    x.set(this.tail);
    x.set(block, this.tail.length);
    const out = new Int16Array(Math.max(0, Math.floor((x.length - this.pos) / this.ratio)));
    for (let i = 0; i < out.length; i++) {
      const at = this.pos + i * this.ratio;
      const start = Math.floor(at), end = Math.max(start + 1, Math.floor(at + this.ratio));
      let sum = 0;
      for (let j = start; j < end; j++) sum += x[j];
      const v = Math.max(-1, Math.min(1, sum / (end - start)));
      out[i] = v < 0 ? v * 32768 : v * 32767;
    }
    const next = this.pos + out.length * this.ratio;
    this.tail = x.slice(Math.floor(next));
    this.pos = next - Math.floor(next);
    return out;
  }
}

// The microphone as PCM16 pieces at `rate` (16 kHz: the realtime tab's; 24 kHz: the duplex
// tab's): AudioWorklet, or ScriptProcessor where there is none
class Microphone {
  constructor(onPcm, rate = IN_RATE) {
    this.onPcm = onPcm; this.rate = rate; this.stream = null; this.ctx = null;
  }

  async start() {
    if (!navigator.mediaDevices) throw new Error("no microphone API here: open the page " +
                                                 "over https or from localhost");
    this.stream = await navigator.mediaDevices.getUserMedia(
      { audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true } });
    this.ctx = new AudioContext();
    const source = this.ctx.createMediaStreamSource(this.stream);
    const resampler = new Pcm16Resampler(this.ctx.sampleRate, this.rate);
    const emit = (f32) => this.onPcm(resampler.push(f32));
    if (this.ctx.audioWorklet) {
      await this.ctx.audioWorklet.addModule("/playground/pcm_worklet.js");
      const node = new AudioWorkletNode(this.ctx, "pcm-capture");
      node.port.onmessage = (e) => emit(e.data);
      source.connect(node);
    } else {
      const node = this.ctx.createScriptProcessor(4096, 1, 1);
      node.onaudioprocess = (e) => emit(e.inputBuffer.getChannelData(0));
      source.connect(node);
      node.connect(this.ctx.destination);
    }
  }

  stop() {
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    if (this.ctx) this.ctx.close();
    this.stream = this.ctx = null;
  }
}

// ---- metrics -------------------------------------------------------------------------------

class Timer {
  constructor() { this.t0 = performance.now(); this.first = null; this.firstAudio = null; }
  mark(kind = "first") { if (this[kind] === null) this[kind] = performance.now(); }
  sec(t) { return t === null ? null : (t - this.t0) / 1000; }

  text(tokens, promptTokens) {
    const total = this.sec(performance.now());
    const parts = promptTokens ? [`prompt ${promptTokens} tokens`] : [];
    if (this.first !== null) parts.push(`first token ${this.sec(this.first).toFixed(3)} s`);
    if (this.firstAudio !== null) parts.push(`first audio ${this.sec(this.firstAudio).toFixed(3)} s`);
    if (tokens && this.first !== null) {
      const span = total - this.sec(this.first);
      if (span > 0) parts.push(`${(tokens / span).toFixed(1)} tokens/s`);
      parts.push(`${tokens} tokens`);
    }
    parts.push(`total ${total.toFixed(3)} s`);
    return parts.join(" · ");
  }
}

// ---- chat ----------------------------------------------------------------------------------

const chat = { history: [], controller: null, player: new PcmPlayer(OUT_RATE) };

function addMessage(log, role, text = "") {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.dataset.role = role;
  div.textContent = text;
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
  return div;
}

async function attachmentParts(files) {
  const parts = [];
  for (const file of files) {
    const dataUrl = await new Promise((ok, bad) => {
      const r = new FileReader();
      r.onload = () => ok(r.result);
      r.onerror = () => bad(r.error);
      r.readAsDataURL(file);
    });
    if (file.type.startsWith("image/")) {
      parts.push({ type: "image_url", image_url: { url: dataUrl } });
    } else if (file.type.startsWith("audio/")) {
      const format = file.type.includes("mpeg") || file.name.endsWith(".mp3") ? "mp3" : "wav";
      parts.push({ type: "input_audio", input_audio: { data: dataUrl.split(",")[1], format } });
    } else if (file.type.startsWith("video/")) {
      parts.push({ type: "video_url", video_url: { url: dataUrl } });
    } else {
      throw new Error(`${file.name}: attach an image, audio or video file`);
    }
  }
  return parts;
}

async function sendChat() {
  const input = $("chat-input");
  const text = input.value.trim();
  const files = [...$("chat-files").files];
  if (!text && !files.length) return;
  const withAudio = $("chat-audio").checked;
  if (withAudio) await chat.player.unlock();
  const content = files.length ? [{ type: "text", text }, ...await attachmentParts(files)] : text;
  const user = addMessage($("chat-log"), "user", text);
  files.forEach((f) => user.append(` [${f.name}]`));
  chat.history.push({ role: "user", content });
  input.value = "";
  $("chat-files").value = "";
  const body = { model: state.model, messages: chat.history, stream: true,
                 stream_options: { include_usage: true },
                 max_tokens: Number($("chat-max-tokens").value) || undefined };
  if (withAudio) Object.assign(body, { modalities: ["text", "audio"], audio: { format: "pcm16" } });
  await streamChat(body);
}

async function streamChat(body) {
  const out = addMessage($("chat-log"), "assistant");
  const timer = new Timer();
  chat.controller = new AbortController();
  $("chat-stop").disabled = false;
  $("chat-send").disabled = true;
  let tokens = 0, usage = null;
  try {
    const res = await api("/v1/chat/completions", { method: "POST", body,
                                                    signal: chat.controller.signal });
    status("");
    for await (const chunk of sseEvents(res)) {
      if (chunk.error) throw new APIError(500, chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (!delta) continue;
      const piece = delta.content || (delta.audio && delta.audio.transcript) || "";
      if (piece) { timer.mark(); tokens++; out.textContent += piece; }
      if (delta.audio && delta.audio.data) { timer.mark("firstAudio"); chat.player.push(delta.audio.data); }
      $("chat-metrics").textContent = timer.text(tokens);
    }
    chat.history.push({ role: "assistant", content: out.textContent });
  } catch (err) {
    // a stopped answer stays in the conversation as far as it got; a failed turn leaves it
    if (err.name === "AbortError" && out.textContent) {
      chat.history.push({ role: "assistant", content: out.textContent });
    } else {
      chat.history.pop();
    }
    out.classList.add("error");
    out.textContent += err.name === "AbortError" ? " [stopped]" : ` [${err.message}]`;
    fail(err);
  } finally {
    $("chat-metrics").textContent = usage ? timer.text(usage.completion_tokens, usage.prompt_tokens)
                                          : timer.text(tokens);
    out.dataset.done = "true";
    chat.controller = null;
    $("chat-stop").disabled = true;
    $("chat-send").disabled = false;
  }
}

function fitChat() {   // attachments and speech only where the model takes and makes them
  const inputs = state.caps.input_modalities;
  const accept = ["image", "audio", "video"].filter((m) => inputs.includes(m));
  $("chat-files").accept = accept.map((m) => `${m}/*`).join(",");
  $("chat-files").hidden = $("chat-files-label").hidden = !accept.length;
  $("chat-files-label").textContent = `Attach (${accept.join(", ")})`;
  $("chat-audio-label").hidden = !state.outputs.includes("audio");
}

function setupChat() {
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); sendChat().catch(fail); });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.player.stop();
  });
  $("chat-clear").addEventListener("click", () => {
    chat.history = [];
    $("chat-log").textContent = "";
    $("chat-metrics").textContent = "";
    $("chat-input").focus();
  });
}

// ---- realtime voice (the OpenAI Realtime protocol on /v1/realtime) -------------------------

const rt = { ws: null, mic: null, talking: false, responding: false, timer: null,
             player: new PcmPlayer(OUT_RATE), line: null };

function rtMode() { return document.querySelector('input[name="rt-mode"]:checked').value; }

function rtSend(event) {
  if (rt.ws && rt.ws.readyState === WebSocket.OPEN) rt.ws.send(JSON.stringify(event));
}

function rtSession() {
  const vad = rtMode() === "vad";
  const output = { format: { type: "audio/pcm", rate: OUT_RATE } };
  if ($("rt-voice").value.trim()) output.voice = $("rt-voice").value.trim();
  const session = {
    type: "realtime", output_modalities: ["audio"],
    audio: { input: { format: { type: "audio/pcm", rate: IN_RATE },
                      turn_detection: vad ? { type: "server_vad", create_response: true,
                                              interrupt_response: true,
                                              silence_duration_ms: Number($("rt-silence").value) || 500 }
                                          : null },
             output },
  };
  if ($("rt-instructions").value.trim()) session.instructions = $("rt-instructions").value.trim();
  return { type: "session.update", session };
}

function rtConnect() {
  const url = new URL(`/v1/realtime?model=${encodeURIComponent(state.model)}`, location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  // a browser's WebSocket sends no headers: the key rides as a subprotocol, as with OpenAI's
  const protocols = apiKey() ? ["realtime", `openai-insecure-api-key.${apiKey()}`] : [];
  rt.ws = new WebSocket(url, protocols);
  rt.ws.onopen = async () => {
    rtSend(rtSession());
    rt.mic = new Microphone((pcm) => {
      if (rtMode() === "vad" || rt.talking) {
        rtSend({ type: "input_audio_buffer.append",
                 audio: bytesToB64(new Uint8Array(pcm.buffer)) });
      }
    });
    try { await rt.mic.start(); } catch (err) { fail(err); rtDisconnect(); return; }
    $("rt-connect").textContent = "Disconnect";
    $("rt-talk").disabled = rtMode() !== "ptt";
    status(rtMode() === "vad" ? "listening: speak any time" : "connected: hold to talk");
  };
  rt.ws.onmessage = (e) => rtEvent(JSON.parse(e.data));
  rt.ws.onclose = (e) => {
    if (rt.ws) status(`realtime closed (${e.code}${e.reason ? ": " + e.reason : ""})`, e.code !== 1000);
    rtDisconnect();
  };
}

function rtDisconnect() {
  const ws = rt.ws;
  rt.ws = null;
  if (ws && ws.readyState <= WebSocket.OPEN) ws.close(1000);
  if (rt.mic) rt.mic.stop();
  rt.mic = null;
  rt.player.stop();
  rt.talking = rt.responding = false;
  $("rt-connect").textContent = "Connect";
  $("rt-talk").disabled = true;
  $("rt-talk").setAttribute("aria-pressed", "false");
}

function rtBargeIn() {   // the person speaks over the answer: stop it here and on the server
  rt.player.stop();
  if (rt.responding) rtSend({ type: "response.cancel" });
}

function rtTurnEnded() { rt.timer = new Timer(); }

const RT_HANDLERS = {
  "input_audio_buffer.speech_started": () => { rtBargeIn(); addMessage($("rt-log"), "user", "🎤 …"); },
  "input_audio_buffer.speech_stopped": rtTurnEnded,
  "response.created": () => { rt.responding = true; rt.line = addMessage($("rt-log"), "assistant"); },
  "response.output_audio.delta": (ev) => {
    if (rt.timer) rt.timer.mark("firstAudio");
    rt.player.push(ev.delta);
  },
  "response.output_audio_transcript.delta": (ev) => rtText(ev.delta),
  "response.output_text.delta": (ev) => rtText(ev.delta),
  "response.done": (ev) => {
    rt.responding = false;
    const usage = ev.response && ev.response.usage;
    if (rt.timer) $("rt-metrics").textContent = rt.timer.text(usage ? usage.output_tokens : 0);
  },
  "error": (ev) => status(`realtime: ${ev.error ? ev.error.message : "error"}`, true),
};

function rtText(delta) {
  if (rt.timer) rt.timer.mark();
  if (!rt.line) rt.line = addMessage($("rt-log"), "assistant");
  rt.line.textContent += delta;
}

function rtEvent(ev) {
  const handle = RT_HANDLERS[ev.type];
  if (handle) handle(ev);
}

function rtTalk(down) {
  if (!rt.ws || rtMode() !== "ptt" || down === rt.talking) return;
  rt.talking = down;
  $("rt-talk").setAttribute("aria-pressed", String(down));
  if (down) {
    rtBargeIn();
    rtSend({ type: "input_audio_buffer.clear" });
    addMessage($("rt-log"), "user", "🎤 …");
  } else {
    rtSend({ type: "input_audio_buffer.commit" });
    rtSend({ type: "response.create" });
    rtTurnEnded();
  }
}

function setupRealtime() {
  $("rt-connect").addEventListener("click", async () => {
    if (rt.ws) return rtDisconnect();
    await rt.player.unlock();
    rtConnect();
  });
  const talk = $("rt-talk");
  talk.addEventListener("pointerdown", () => rtTalk(true));
  for (const ev of ["pointerup", "pointerleave", "blur"]) talk.addEventListener(ev, () => rtTalk(false));
  talk.addEventListener("keydown", (e) => {
    if (e.key === " " || e.key === "Enter") { e.preventDefault(); if (!e.repeat) rtTalk(true); }
  });
  talk.addEventListener("keyup", (e) => { if (e.key === " " || e.key === "Enter") rtTalk(false); });
  document.querySelectorAll('input[name="rt-mode"]').forEach((r) => r.addEventListener("change", () => {
    rtSend(rtSession());
    talk.disabled = !rt.ws || rtMode() !== "ptt";
  }));
}

// ---- images --------------------------------------------------------------------------------

async function generateImages() {
  const body = { model: state.model, prompt: $("images-prompt").value,
                 n: Number($("images-n").value) || 1 };
  const size = $("images-size").value.trim();
  if (size) body.size = size;
  if ($("images-steps").value) body.num_inference_steps = Number($("images-steps").value);
  if ($("images-seed").value) body.seed = Number($("images-seed").value);
  const timer = new Timer();
  $("images-go").disabled = true;
  $("images-metrics").textContent = "";
  // the answer comes whole: meanwhile a working bar and the seconds so far
  $("images-working").hidden = false;
  const ticker = setInterval(() => {
    $("images-elapsed").textContent =
      `generating ${body.n} image${body.n > 1 ? "s" : ""}… ${timer.sec(performance.now()).toFixed(1)} s`;
  }, 100);
  try {
    const answer = await (await api("/v1/images/generations", { method: "POST", body })).json();
    status("");
    const grid = $("images-grid");
    grid.textContent = "";
    answer.data.forEach((img, i) => {
      const fig = document.createElement("figure");
      const el = document.createElement("img");
      el.src = `data:image/${answer.output_format};base64,${img.b64_json}`;
      el.alt = `${body.prompt} (${i + 1} of ${answer.data.length})`;
      const cap = document.createElement("figcaption");
      cap.textContent = `${answer.size}${body.seed !== undefined ? ` · seed ${body.seed}` : ""}`;
      fig.append(el, cap);
      grid.appendChild(fig);
    });
    const total = timer.sec(performance.now());
    $("images-metrics").textContent =
      `${answer.data.length} images · total ${total.toFixed(3)} s · ` +
      `${(total / answer.data.length).toFixed(3)} s per image`;
  } catch (err) {
    $("images-metrics").textContent = "";
    fail(err);
  } finally {
    clearInterval(ticker);
    $("images-working").hidden = true;
    $("images-go").disabled = false;
  }
}

// ---- speech --------------------------------------------------------------------------------

async function loadVoices() {
  const voices = (await (await api("/v1/audio/voices")).json()).data;
  const select = $("speech-voice");
  select.textContent = "";
  for (const v of voices) select.add(new Option(`${v.name} (${v.type})`, v.name));
}

async function speak() {
  const body = { model: state.model, input: $("speech-input").value, response_format: "wav" };
  if ($("speech-voice").value) body.voice = $("speech-voice").value;
  const timer = new Timer();
  $("speech-go").disabled = true;
  try {
    const res = await api("/v1/audio/speech", { method: "POST", body });
    const reader = res.body.getReader();
    const pieces = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      timer.mark("firstAudio");
      pieces.push(value);
    }
    const audio = $("speech-audio");
    if (audio.src) URL.revokeObjectURL(audio.src);
    audio.src = URL.createObjectURL(new Blob(pieces, { type: "audio/wav" }));
    audio.hidden = false;
    audio.play().catch(() => {});
    status("");
    $("speech-metrics").textContent = timer.text(0);
  } catch (err) {
    fail(err);
  } finally {
    $("speech-go").disabled = false;
  }
}

// ---- video (jobs) --------------------------------------------------------------------------

const video = { poll: null };

async function createVideo() {
  const body = { model: state.model, prompt: $("video-prompt").value };
  if ($("video-size").value.trim()) body.size = $("video-size").value.trim();
  for (const [id, key] of [["video-frames", "num_frames"], ["video-steps", "num_inference_steps"],
                           ["video-seed", "seed"]]) {
    if ($(id).value) body[key] = Number($(id).value);
  }
  try {
    await api("/v1/videos", { method: "POST", body });
    status("job queued");
    await refreshVideos();
  } catch (err) { fail(err); }
}

function jobItem(job) {
  const li = document.createElement("li");
  li.id = `job-${job.id}`;
  li.dataset.status = job.status;
  const bar = document.createElement("progress");
  bar.max = 100;
  bar.setAttribute("aria-label", `progress of ${job.id}`);
  li.append(document.createElement("span"), bar);
  showProgress(li, job);
  if (job.error) li.append(` ${job.error.message}`);
  if (job.status === "completed") {
    li.append(jobButton("Play", () => playVideo(job.id, li).catch(fail)));
  }
  if (job.status === "queued" || job.status === "in_progress") {
    li.append(jobButton("Cancel", () => api(`/v1/videos/${job.id}/cancel`, { method: "POST" })
      .then(refreshVideos).catch(fail)));
  }
  li.append(jobButton("Delete", () => api(`/v1/videos/${job.id}`, { method: "DELETE" })
    .then(refreshVideos).catch(fail)));
  return li;
}

function showProgress(li, job) {
  li.firstChild.textContent = `${job.prompt} · ${job.size} · ${job.seconds} s · ${job.status} `;
  li.querySelector("progress").value = job.progress;
}

function jobButton(text, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.addEventListener("click", onClick);
  return b;
}

async function playVideo(id, li) {
  // fetched with the key (a <video src> could not send it), then played from a blob; WebM
  // where this browser plays no H.264
  const el = li.querySelector("video") || li.appendChild(document.createElement("video"));
  const mp4 = el.canPlayType('video/mp4; codecs="avc1.42E01E"') !== "";
  const blob = await (await api(`/v1/videos/${id}/content${mp4 ? "" : "?format=webm"}`)).blob();
  el.controls = true;
  el.setAttribute("aria-label", `video ${id}`);
  el.src = URL.createObjectURL(blob);
  el.play().catch(() => {});
}

async function refreshVideos() {
  clearTimeout(video.poll);
  const jobs = (await (await api("/v1/videos?limit=20")).json()).data;
  const list = $("video-jobs");
  jobs.forEach((job, i) => {
    const old = $(`job-${job.id}`);
    // progress updates in place (keyboard focus stays on the job's buttons); a new status
    // brings new buttons; a new job goes where the list (newest first) has it
    if (old && old.dataset.status === job.status) showProgress(old, job);
    else if (old) old.replaceWith(jobItem(job));
    else list.insertBefore(jobItem(job), list.children[i] || null);
  });
  const ids = new Set(jobs.map((j) => `job-${j.id}`));
  [...list.children].forEach((li) => { if (!ids.has(li.id)) li.remove(); });
  if (jobs.some((j) => j.status === "queued" || j.status === "in_progress")) {
    video.poll = setTimeout(() => refreshVideos().catch(fail), 1500);
  }
}

// ---- tabs and start-up ---------------------------------------------------------------------

const TABS = {   // tab -> the route that must serve the model (and a condition of its own)
  chat: (c) => c.endpoints.includes("/v1/chat/completions") && state.outputs.includes("text"),
  realtime: (c) => c.endpoints.includes("/v1/realtime"),
  duplex: (c) => c.endpoints.includes("/v1/duplex"),      // duplex.js
  images: (c) => c.endpoints.includes("/v1/images/generations"),
  speech: (c) => c.endpoints.includes("/v1/audio/speech"),
  video: (c) => c.endpoints.includes("/v1/videos"),
};

function showTab(name, focus = false) {
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    const on = tab.dataset.tab === name;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(tab.getAttribute("aria-controls")).hidden = !on;
    if (on && focus) tab.focus();
  }
  location.hash = name;
}

function setupTabs(available) {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  for (const tab of tabs) {
    tab.hidden = !available.includes(tab.dataset.tab);
    tab.addEventListener("click", () => showTab(tab.dataset.tab));
    tab.addEventListener("keydown", (e) => {   // arrow keys move between tabs, as ARIA says
      const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
      if (!step) return;
      const i = available.indexOf(tab.dataset.tab);
      showTab(available[(i + step + available.length) % available.length], true);
    });
  }
  const wanted = location.hash.slice(1);
  showTab(available.includes(wanted) ? wanted : available[0]);
}

async function loadModel() {
  const card = (await (await api("/v1/models")).json()).data[0];
  state.model = card.id;
  state.outputs = card.modalities;
  state.caps = card.capabilities;
  $("model-name").textContent = card.id;
  $("model-caps").textContent = `(in: ${state.caps.input_modalities.join(", ")}; ` +
                                `out: ${card.modalities.join(", ")})`;
  const available = Object.keys(TABS).filter((t) => TABS[t](state.caps));
  if (!available.length) return status("this model offers nothing the playground shows", true);
  setupTabs(available);
  if (available.includes("chat")) fitChat();
  if (available.includes("speech")) loadVoices().catch(fail);
  if (available.includes("video")) refreshVideos().catch(fail);
  document.body.dataset.ready = "true";
  status("");
}

function start() {
  setupChat();
  setupRealtime();
  setupDuplex();
  $("images-form").addEventListener("submit", (e) => { e.preventDefault(); generateImages(); });
  $("speech-form").addEventListener("submit", (e) => { e.preventDefault(); speak(); });
  $("video-form").addEventListener("submit", (e) => { e.preventDefault(); createVideo(); });
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    if (!state.model) loadModel().catch(fail); else status("key saved");
  });
  loadModel().catch((err) => {
    fail(err);
    if (err.status === 401) status("this server needs an API key: enter it above", true);
  });
}

start();
