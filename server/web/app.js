// The chat page: conversations kept in localStorage, answers streamed from /v1/chat/completions (SSE read
// from fetch), reasoning shown collapsed, and a model picker over /api/models that loads through
// /api/models/load. State the tests read is mirrored in data- attributes (body.dataset.modelState, each
// assistant message's data-state and data-chunks). Settings (temperature, answer length, system prompt)
// are kept in localStorage; each answer shows its speed (time to first token, tokens/s from the server's
// `timings`, the share of experts served from VRAM); answers can be copied and regenerated, questions
// edited. A model that reads pictures (`/props` `modalities.vision` once loaded, the registry's
// `multimodal` before) gets a Picture button (and paste into the box): the pictures go with the next
// message as `image_url` data-URL parts and show in the conversation.
"use strict";

const STORE = "polystrata.conversations";
const CURRENT = "polystrata.current";
const el = (id) => document.getElementById(id);
const ui = {
  picker: el("model-picker"), name: el("model-name"), status: el("model-status"), notice: el("notice"),
  messages: el("messages"), list: el("conversations"), input: el("input"), send: el("send"),
  stop: el("stop"), form: el("composer"), newChat: el("new-chat"),
  temperature: el("set-temperature"), maxTokens: el("set-max-tokens"), system: el("set-system"),
  attach: el("attach"), file: el("picture-file"), attachments: el("attachments"),
};
// The largest picture the page attaches: its base64 (4/3 of it) goes in every request of the
// conversation, whose body the server takes up to 8 MiB by default (`--max-body-mib`).
const MAX_PICTURE_BYTES = 5 * 1024 * 1024;
const SETTINGS = { temperature: "polystrata.temperature", maxTokens: "polystrata.maxTokens", system: "polystrata.system" };
const state = { models: [], current: null, conversations: [], active: null, abort: null, loading: false, vision: false, pending: [] };

// --- requests ---------------------------------------------------------------------------------------
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem("polystrata.apiKey");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    const e = body.error || body;
    return (e.message || JSON.stringify(e)) + " (HTTP " + resp.status + ")";
  } catch (_) {
    return "HTTP " + resp.status;
  }
}

async function api(path, body) {
  const init = body === undefined ? { headers: headers() } : { method: "POST", headers: headers(), body: JSON.stringify(body) };
  const resp = await fetch(path, init);
  if (resp.status === 401) {
    const key = prompt("This server needs an API key:");
    if (key) { localStorage.setItem("polystrata.apiKey", key); return api(path, body); }
  }
  if (!resp.ok) throw new Error(await errorText(resp));
  return resp.json();
}

// --- models -----------------------------------------------------------------------------------------
function setStatus(text, kind) {
  ui.status.textContent = text;
  ui.status.className = kind === "error" ? "error" : "";
  document.body.dataset.modelState = kind || "";
}

function currentEntry() {
  return state.models.find((m) => m.id === state.current) || null;
}

function showNotice(entry) {
  const lines = [];
  if (entry && entry.base) lines.push(entry.display_name + " is a small base model: it continues text and does not follow a conversation.");
  if (entry && entry.notes) lines.push(entry.notes);
  if (entry && entry.context_note) lines.push(entry.context_note + ".");
  ui.notice.textContent = lines.join(" ");
  ui.notice.hidden = lines.length === 0;
}

async function refreshModels() {
  const data = await api("/api/models");
  state.models = data.models || [];
  state.current = data.current || null;
  ui.picker.innerHTML = "";
  for (const m of state.models) {
    const option = document.createElement("option");
    option.value = m.id;
    // The name once: a display name that already holds the id is shown alone.
    const name = m.display_name || m.id;
    option.textContent = name.includes(m.id) ? name : name + " (" + m.id + ")";
    if (m.status === "unavailable") { option.disabled = true; option.title = m.problem || "unavailable"; option.textContent += " - unavailable"; }
    ui.picker.appendChild(option);
  }
  ui.picker.hidden = state.models.length < 2;
  if (state.current) ui.picker.value = state.current;
  const entry = currentEntry();
  ui.name.textContent = state.models.length < 2 && state.models[0] ? state.models[0].display_name || state.models[0].id : "";
  if (!state.models.length) setStatus("no models installed", "error");
  else if (entry) setStatus(entry.status === "loaded" ? "loaded" : entry.status, entry.status === "loaded" ? "loaded" : "unloaded");
  else setStatus("no model loaded", "unloaded");
  showNotice(entry);
  await refreshVision(entry);
}

// --- pictures ---------------------------------------------------------------------------------------
// Whether the model in use reads pictures: the loaded engine's word (`/props`), else the registry's
// (`multimodal`: its run config names a projector that is there).
async function refreshVision(entry) {
  let vision = !!(entry && entry.multimodal);
  if (entry && entry.status === "loaded") {
    try {
      const props = await api("/props");
      vision = !!(props.modalities && props.modalities.vision);
    } catch (_) { /* unloaded meanwhile: the registry's word stands */ }
  }
  state.vision = vision;
  ui.attach.hidden = !vision;
  document.body.dataset.vision = vision ? "1" : "";
  if (!vision && state.pending.length) { state.pending = []; renderPending(); }
}

function renderPending() {
  ui.attachments.innerHTML = "";
  state.pending.forEach((url, i) => {
    const box = document.createElement("span");
    box.className = "attachment";
    const img = document.createElement("img");
    img.src = url;
    img.alt = "picture to send";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "x";
    remove.title = "Remove this picture";
    remove.onclick = () => { state.pending.splice(i, 1); renderPending(); };
    box.appendChild(img);
    box.appendChild(remove);
    ui.attachments.appendChild(box);
  });
  ui.attachments.hidden = state.pending.length === 0;
}

// Reads picture files (chosen or pasted) into data URLs waiting for the next message.
function attachFiles(files) {
  for (const f of files) {
    if (!/^image\/(png|jpeg|webp)$/.test(f.type)) { setStatus("not a PNG, JPEG or WebP picture: " + (f.name || f.type), "error"); continue; }
    if (f.size > MAX_PICTURE_BYTES) { setStatus("the picture is larger than 5 MB: " + f.name, "error"); continue; }
    const reader = new FileReader();
    reader.onload = () => { state.pending.push(reader.result); renderPending(); };
    reader.readAsDataURL(f);
  }
}

// A message's content as the API takes it: the text alone, or the pictures then the text as parts.
function apiContent(m) {
  if (!m.pictures || !m.pictures.length) return m.content;
  const parts = m.pictures.map((url) => ({ type: "image_url", image_url: { url } }));
  if (m.content) parts.push({ type: "text", text: m.content });
  return parts;
}

async function loadModel(id) {
  if (state.loading) return;
  state.loading = true;
  ui.picker.disabled = true;
  ui.send.disabled = true;
  const started = Date.now();
  const tick = () => setStatus("loading " + id + " ... " + Math.round((Date.now() - started) / 1000) + " s", "loading");
  tick();
  const timer = setInterval(tick, 500);
  try {
    await api("/api/models/load", { model: id });
    clearInterval(timer);
    await refreshModels();
    setStatus("loaded in " + ((Date.now() - started) / 1000).toFixed(1) + " s", "loaded");
  } catch (e) {
    clearInterval(timer);
    await refreshModels().catch(() => {});
    setStatus("could not load " + id + ": " + e.message, "error");
  } finally {
    state.loading = false;
    ui.picker.disabled = false;
    ui.send.disabled = state.abort !== null;
  }
}

// --- conversations ----------------------------------------------------------------------------------
function save() {
  try { localStorage.setItem(STORE, JSON.stringify(state.conversations)); } catch (_) { /* full: keep in memory */ }
  if (state.active) localStorage.setItem(CURRENT, state.active.id); else localStorage.removeItem(CURRENT);
}

function newConversation() {
  const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 7), title: "New chat", messages: [], updated: Date.now() };
  state.conversations.unshift(c);
  state.active = c;
  save();
  renderAll();
}

function deleteConversation(id) {
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.active && state.active.id === id) state.active = state.conversations[0] || null;
  save();
  renderAll();
}

function renderList() {
  ui.list.innerHTML = "";
  for (const c of state.conversations) {
    const li = document.createElement("li");
    li.className = state.active && c.id === state.active.id ? "active" : "";
    li.dataset.id = c.id;
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = c.title;
    const del = document.createElement("button");
    del.className = "delete";
    del.type = "button";
    del.title = "Delete this conversation";
    del.textContent = "\u2715";
    del.onclick = (ev) => { ev.stopPropagation(); deleteConversation(c.id); };
    li.onclick = () => { if (!state.abort) { state.active = c; save(); renderAll(); } };
    li.append(title, del);
    ui.list.appendChild(li);
  }
}

function messageView(m) {
  const div = document.createElement("div");
  div.className = "message " + m.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : (m.model || "Assistant");
  div.appendChild(role);
  if (m.role === "assistant") {
    const details = document.createElement("details");
    details.className = "reasoning";
    details.hidden = !m.reasoning;
    details.innerHTML = "<summary>Reasoning</summary>";
    const rtext = document.createElement("div");
    rtext.className = "reasoning-text";
    rtext.textContent = m.reasoning || "";
    details.appendChild(rtext);
    div.appendChild(details);
  }
  if (m.pictures && m.pictures.length) {
    const pics = document.createElement("div");
    pics.className = "pictures";
    for (const url of m.pictures) {
      const img = document.createElement("img");
      img.src = url;
      img.alt = "picture sent";
      pics.appendChild(img);
    }
    div.appendChild(pics);
  }
  const content = document.createElement("div");
  content.className = "content";
  if (m.role === "assistant") content.innerHTML = renderMarkdown(m.content || "");
  else content.textContent = m.content;
  div.appendChild(content);
  const error = document.createElement("div");
  error.className = "error";
  error.textContent = m.error || "";
  div.appendChild(error);
  const speed = document.createElement("div");
  speed.className = "speed";
  speed.textContent = m.speed || "";
  speed.hidden = !m.speed;
  div.appendChild(speed);
  div.appendChild(actions(m));
  div.dataset.state = m.state || "done";
  return div;
}

// Copy an answer, regenerate the last one, edit a question (the conversation is cut there and the
// question goes back into the input).
function actions(m) {
  const bar = document.createElement("div");
  bar.className = "actions";
  const button = (cls, text, title, onclick) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = cls;
    b.textContent = text;
    b.title = title;
    b.onclick = onclick;
    bar.appendChild(b);
  };
  if (m.role === "assistant") {
    button("copy", "Copy", "Copy the answer", () => copyText(m.content || ""));
    button("regenerate", "Regenerate", "Answer the question again", () => regenerate(m));
  } else {
    button("edit", "Edit", "Edit this question (later messages are removed)", () => edit(m));
  }
  return bar;
}

function copyText(text) {
  if (navigator.clipboard && navigator.clipboard.writeText) {
    navigator.clipboard.writeText(text).catch(() => fallbackCopy(text));
  } else fallbackCopy(text);
}

function fallbackCopy(text) {
  const t = document.createElement("textarea");
  t.value = text;
  document.body.appendChild(t);
  t.select();
  try { document.execCommand("copy"); } catch (_) { /* nothing more to try */ }
  t.remove();
}

function regenerate(m) {
  const conv = state.active;
  if (!conv || state.abort || state.loading) return;
  const at = conv.messages.indexOf(m);
  if (at < 1) return;
  const question = conv.messages[at - 1];
  conv.messages = conv.messages.slice(0, at - 1);
  save();
  send(question.content, question.pictures || []);
}

function edit(m) {
  const conv = state.active;
  if (!conv || state.abort) return;
  const at = conv.messages.indexOf(m);
  if (at < 0) return;
  conv.messages = conv.messages.slice(0, at);
  save();
  renderAll();
  ui.input.value = m.content;
  state.pending = state.vision ? (m.pictures || []).slice() : [];
  renderPending();
  ui.input.focus();
}

// The settings in force (the inputs keep them in localStorage as they are typed).
function settings() {
  const t = (localStorage.getItem(SETTINGS.temperature) || "").trim();
  const n = Number(localStorage.getItem(SETTINGS.maxTokens));
  return { temperature: t === "" ? null : Number(t), maxTokens: n > 0 ? n : null, system: localStorage.getItem(SETTINGS.system) || "" };
}

function speedText(timings, firstMs, vramShare) {
  if (!timings) return "";
  const parts = [];
  if (firstMs !== null) parts.push("first token " + (firstMs / 1000).toFixed(2) + " s");
  parts.push(timings.predicted_per_second.toFixed(1) + " tokens/s");
  parts.push(timings.predicted_n + " tokens");
  if (vramShare !== undefined && vramShare !== null) parts.push("experts from VRAM " + Math.round(vramShare * 100) + "%");
  return parts.join(" \u00b7 ");
}

function renderMessages() {
  ui.messages.innerHTML = "";
  if (!state.active) return;
  for (const m of state.active.messages) ui.messages.appendChild(messageView(m));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function renderAll() { renderList(); renderMessages(); }

// --- streaming --------------------------------------------------------------------------------------
// Calls onEvent with each SSE `data:` payload (parsed JSON) until `[DONE]` or the end of the body.
async function readSse(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

async function send(text, pictures) {
  if (!state.active) newConversation();
  const conv = state.active;
  const model = state.current || (state.models.find((m) => m.status !== "unavailable") || {}).id;
  const question = { role: "user", content: text };
  if (pictures && pictures.length) question.pictures = pictures;
  conv.messages.push(question);
  if (conv.title === "New chat") conv.title = text ? text.slice(0, 40) : "Picture";
  const reply = { role: "assistant", content: "", reasoning: "", model, state: "streaming" };
  conv.messages.push(reply);
  conv.updated = Date.now();
  save();
  renderAll();
  const view = ui.messages.lastElementChild;
  const contentEl = view.querySelector(".content");
  const reasoningEl = view.querySelector(".reasoning");
  let chunks = 0;
  let scheduled = false;
  const paint = () => {
    scheduled = false;
    contentEl.innerHTML = renderMarkdown(reply.content);
    reasoningEl.hidden = !reply.reasoning;
    reasoningEl.querySelector(".reasoning-text").textContent = reply.reasoning;
    view.dataset.chunks = String(chunks);
    ui.messages.scrollTop = ui.messages.scrollHeight;
  };
  const controller = new AbortController();
  state.abort = controller;
  ui.send.disabled = true;
  ui.stop.hidden = false;
  const set = settings();
  const history = conv.messages.filter((m) => m !== reply && !m.error).map((m) => ({ role: m.role, content: apiContent(m) }));
  const body = { model, stream: true, messages: set.system ? [{ role: "system", content: set.system }].concat(history) : history };
  if (set.maxTokens) body.max_tokens = set.maxTokens;
  if (set.temperature !== null && !Number.isNaN(set.temperature)) body.temperature = set.temperature;
  const sent = performance.now();
  let firstMs = null;
  let timings = null;
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    await readSse(resp, (event) => {
      if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
      const delta = (event.choices && event.choices[0] && event.choices[0].delta) || {};
      if (event.timings) timings = event.timings;
      if ((delta.reasoning_content || delta.content) && firstMs === null) firstMs = performance.now() - sent;
      if (delta.reasoning_content) { reply.reasoning += delta.reasoning_content; chunks++; }
      if (delta.content) { reply.content += delta.content; chunks++; }
      if (!scheduled) { scheduled = true; requestAnimationFrame(paint); }
    });
    reply.state = "done";
  } catch (e) {
    if (e.name === "AbortError") reply.state = "stopped";
    else { reply.state = "error"; reply.error = e.message; controller.abort(); }
  } finally {
    state.abort = null;
    ui.stop.hidden = true;
    ui.send.disabled = state.loading;
    paint();
    view.querySelector(".error").textContent = reply.error || (reply.state === "stopped" ? "(stopped)" : "");
    reply.speed = speedText(timings, firstMs, timings ? timings.experts_vram_share : null);
    const speedEl = view.querySelector(".speed");
    speedEl.textContent = reply.speed;
    speedEl.hidden = !reply.speed;
    view.dataset.state = reply.state;
    conv.updated = Date.now();
    save();
    // The header follows the server: a message may have loaded the model again (after an unload) or
    // switched it.
    refreshModels().catch(() => {});
  }
}

// --- wiring -----------------------------------------------------------------------------------------
ui.form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = ui.input.value.trim();
  if ((!text && !state.pending.length) || state.abort || state.loading) return;
  ui.input.value = "";
  const pictures = state.pending;
  state.pending = [];
  renderPending();
  send(text, pictures);
});
ui.attach.addEventListener("click", () => ui.file.click());
ui.file.addEventListener("change", () => { attachFiles([...ui.file.files]); ui.file.value = ""; });
// A picture pasted into the box is attached (for a model that reads pictures); text pastes as usual.
ui.input.addEventListener("paste", (ev) => {
  if (!state.vision || !ev.clipboardData) return;
  const files = [...ev.clipboardData.items].filter((i) => i.kind === "file" && i.type.startsWith("image/")).map((i) => i.getAsFile()).filter(Boolean);
  if (files.length) { ev.preventDefault(); attachFiles(files); }
});
ui.input.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); ui.form.requestSubmit(); }
});
ui.stop.addEventListener("click", () => { if (state.abort) state.abort.abort(); });
ui.newChat.addEventListener("click", () => { if (!state.abort) newConversation(); });
ui.picker.addEventListener("change", () => loadModel(ui.picker.value));
// Settings are kept as they are typed.
ui.temperature.addEventListener("input", () => localStorage.setItem(SETTINGS.temperature, ui.temperature.value));
ui.maxTokens.addEventListener("input", () => localStorage.setItem(SETTINGS.maxTokens, ui.maxTokens.value));
ui.system.addEventListener("input", () => localStorage.setItem(SETTINGS.system, ui.system.value));

(function start() {
  try { state.conversations = JSON.parse(localStorage.getItem(STORE) || "[]"); } catch (_) { state.conversations = []; }
  // A reply cut off by closing the page is kept as it stood.
  for (const c of state.conversations) for (const m of c.messages) if (m.state === "streaming") m.state = "stopped";
  ui.temperature.value = localStorage.getItem(SETTINGS.temperature) || "";
  ui.maxTokens.value = localStorage.getItem(SETTINGS.maxTokens) || "";
  ui.system.value = localStorage.getItem(SETTINGS.system) || "";
  const id = localStorage.getItem(CURRENT);
  state.active = state.conversations.find((c) => c.id === id) || state.conversations[0] || null;
  renderAll();
  refreshModels().then(() => { document.body.dataset.ready = "1"; })
    .catch((e) => { setStatus("cannot reach the server: " + e.message, "error"); document.body.dataset.ready = "1"; });
})();
