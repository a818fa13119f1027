// eagerlm's chat page: talks to this server's own /v1/chat/completions, streamed.
// The conversation and the settings live in the browser (localStorage), nowhere else.
"use strict";

const STORE_KEY = "eagerlm.chat.v1";
const SETTINGS = ["system", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed",
                  "api_key", "custom"];
const NUMBERS = new Set(["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"]);

const $ = (id) => document.getElementById(id);
const state = load();
let running = null;  // {controller, message} while a reply streams

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE_KEY) || "{}");
    return {messages: Array.isArray(saved.messages) ? saved.messages : [],
            settings: saved.settings || {}};
  } catch (e) {
    return {messages: [], settings: {}};
  }
}

function save() {  // the model's name is asked of the server each time, not kept
  localStorage.setItem(STORE_KEY, JSON.stringify({messages: state.messages,
                                                  settings: state.settings}));
}

// -- markdown ------------------------------------------------------------------------------
// A small hand-written renderer, on purpose: the page must work offline and fetch nothing
// from outside this server (no CDN), and it has no build step that could bundle a library.
// It covers what chat replies use: fenced code blocks, headings, lists, quotes, rules,
// paragraphs, and inline code, bold, italics and http(s) links. Everything is escaped
// first, so a reply cannot inject HTML.

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

function inline(text) {
  const codes = [];
  let out = escapeHtml(text).replace(/`([^`\n]+)`/g, (m, code) => {
    codes.push(code);
    return `\u0000${codes.length - 1}\u0000`;
  });
  out = out
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/__([^_\n]+)__/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
    .replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
             '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
  return out.replace(/\u0000(\d+)\u0000/g, (m, i) => `<code>${codes[Number(i)]}</code>`);
}

const LIST_ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;
const BLOCK_START = /^(```|#{1,6}\s|>|\s*([-*+]|\d+[.)])\s+|(-{3,}|\*{3,}|_{3,})\s*$)/;

function renderMarkdown(source) {
  const lines = source.split("\n");
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^```\s*([\w+.-]*)\s*$/);
    if (fence) {  // a code block, closed or (while streaming) not yet
      const code = [];
      i += 1;
      while (i < lines.length && !/^```\s*$/.test(lines[i])) code.push(lines[i++]);
      i += 1;
      const lang = fence[1] ? ` class="language-${escapeHtml(fence[1])}"` : "";
      html.push(`<pre><code${lang}>${escapeHtml(code.join("\n"))}</code></pre>`);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const n = heading[1].length;
      html.push(`<h${n}>${inline(heading[2])}</h${n}>`);
      i += 1;
      continue;
    }
    if (/^(-{3,}|\*{3,}|_{3,})\s*$/.test(line)) {
      html.push("<hr>");
      i += 1;
      continue;
    }
    if (/^>/.test(line)) {
      const quoted = [];
      while (i < lines.length && /^>/.test(lines[i])) quoted.push(lines[i++].replace(/^>\s?/, ""));
      html.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
      continue;
    }
    const item = line.match(LIST_ITEM);
    if (item) {
      const ordered = /\d/.test(item[1]);
      const items = [];
      while (i < lines.length) {
        const m = lines[i].match(LIST_ITEM);
        if (m) items.push(m[2]);
        else if (/^\s+\S/.test(lines[i]) && items.length) items[items.length - 1] += " " + lines[i].trim();
        else break;
        i += 1;
      }
      const tag = ordered ? "ol" : "ul";
      html.push(`<${tag}>${items.map((t) => `<li>${inline(t)}</li>`).join("")}</${tag}>`);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const paragraph = [];
    while (i < lines.length && lines[i].trim() && !BLOCK_START.test(lines[i])) {
      paragraph.push(lines[i++]);
    }
    if (!paragraph.length) paragraph.push(lines[i++]);
    html.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
  }
  return html.join("\n");
}

// -- the conversation on screen ----------------------------------------------------------

function messageElement(message) {
  const el = document.createElement("div");
  el.className = `message ${message.role}`;
  update(el, message);
  return el;
}

function update(el, message) {
  if (message.role === "user") {
    el.textContent = message.content;
    return;
  }
  el.replaceChildren();
  if (message.reasoning) {
    const details = document.createElement("details");
    details.className = "thinking";
    const summary = document.createElement("summary");
    summary.textContent = running && running.message === message && !message.content
      ? "Thinking…" : "Thought";
    const thought = document.createElement("div");
    thought.className = "thought";
    thought.textContent = message.reasoning;
    details.append(summary, thought);
    el.append(details);
  }
  const content = document.createElement("div");
  content.className = "content";
  content.innerHTML = renderMarkdown(message.content || "");
  el.append(content);
  if (message.error) {
    const error = document.createElement("div");
    error.className = "error";
    error.textContent = message.error;
    el.append(error);
  }
  if (message.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = message.stats;
    el.append(stats);
  }
}

function renderAll() {
  $("messages").replaceChildren(...state.messages.map(messageElement));
  scrollDown();
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

// -- settings ------------------------------------------------------------------------------

function showSettings() {
  for (const name of SETTINGS) $(name).value = state.settings[name] ?? "";
}

function readSettings() {
  for (const name of SETTINGS) state.settings[name] = $(name).value;
  save();
}

function requestFields() {
  const s = state.settings;
  const fields = {};
  for (const name of NUMBERS) {
    if (s[name] !== undefined && String(s[name]).trim() !== "") fields[name] = Number(s[name]);
  }
  if (s.custom && s.custom.trim()) {
    let custom;
    try {
      custom = JSON.parse(s.custom);
    } catch (e) {
      throw new Error(`The extra request fields are not valid JSON: ${e.message}`);
    }
    if (custom === null || typeof custom !== "object" || Array.isArray(custom)) {
      throw new Error("The extra request fields must be a JSON object.");
    }
    Object.assign(fields, custom);
  }
  return fields;
}

function headers() {
  const h = {"Content-Type": "application/json"};
  if (state.settings.api_key) h.Authorization = `Bearer ${state.settings.api_key}`;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    if (!r.ok) throw new Error(`${r.status}`);
    const body = await r.json();
    state.model = body.data[0].id;
    $("model").textContent = state.model;
  } catch (e) {
    $("model").textContent = "(model unknown: set the API key in Settings?)";
  }
}

// -- a reply, streamed ---------------------------------------------------------------------

async function send(text) {
  readSettings();
  state.messages.push({role: "user", content: text});
  const reply = {role: "assistant", content: "", reasoning: ""};
  state.messages.push(reply);
  save();
  renderAll();
  const el = $("messages").lastElementChild;
  const controller = new AbortController();
  running = {controller, message: reply};
  setRunning(true);

  const history = state.messages.slice(0, -1).filter((m) => !m.error || m.content)
    .map((m) => ({role: m.role, content: m.content}));
  if (state.settings.system && state.settings.system.trim()) {
    history.unshift({role: "system", content: state.settings.system});
  }
  let first = null;
  let tokens = null;
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; update(el, reply); scrollDown(); });
  };
  try {
    if (!state.model) await loadModel();
    const body = {...requestFields(), model: state.model, messages: history, stream: true,
                  stream_options: {include_usage: true}};
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body),
      signal: controller.signal});
    if (!r.ok) {
      let message = `${r.status} ${r.statusText}`;
      try { message = (await r.json()).error.message || message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    for await (const chunk of events(r.body)) {
      if (chunk.error) throw new Error(chunk.error.message || "the server ended the reply");
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (!delta) continue;
      if (delta.reasoning_content || delta.content) first = first || performance.now();
      reply.reasoning += delta.reasoning_content || "";
      reply.content += delta.content || "";
      redraw();
    }
    reply.stats = stats(tokens, first);
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stats = "stopped" + (first ? ` after ${((performance.now() - first) / 1000).toFixed(1)} s` : "");
    } else {
      reply.error = e.message;
    }
  } finally {
    running = null;
    setRunning(false);
    save();
    update(el, reply);
    scrollDown();
  }
}

// "N tokens · R tok/s": the rate of the tokens after the first (the first waits for the
// prompt's prefill), over the time since the first one came.
function stats(tokens, first) {
  if (tokens === null) return "";
  if (tokens < 2 || first === null) return `${tokens} token${tokens === 1 ? "" : "s"}`;
  const seconds = (performance.now() - first) / 1000;
  return `${tokens} tokens · ${((tokens - 1) / Math.max(seconds, 1e-3)).toFixed(1)} tok/s`;
}

// The server-sent events of a response body, as parsed JSON chunks (until [DONE]).
async function* events(stream) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;  // comments (keep-alives), event names
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("prompt").disabled = on;
  if (!on) $("prompt").focus();
}

// -- wiring --------------------------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || running) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => running && running.controller.abort());
$("new-chat").addEventListener("click", () => {
  if (running) running.controller.abort();
  state.messages = [];
  save();
  renderAll();
});
$("toggle-settings").addEventListener("click", () => {
  const panel = $("settings");
  panel.hidden = !panel.hidden;
  $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
});
for (const name of SETTINGS) $(name).addEventListener("change", readSettings);

showSettings();
renderAll();
loadModel();
