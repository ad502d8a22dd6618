// The chat page of `jaxlm serve` (docs/serve.md, "Chat page"): a conversation with the served model over the server's
// own /v1/chat/completions, streamed. The conversation and the settings stay in this browser's local storage; the
// API key, when the server needs one, in this tab's session storage only. The model's text is only ever put in the
// page as text nodes (never as HTML), whatever Markdown it holds.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "jaxlm.chat";
const KEY = "jaxlm.key";
const FIELDS = ["system", "temperature", "top_p", "max_tokens"];

let chat = load();  // {system, temperature, top_p, max_tokens: the fields' texts; messages: [...]}
let model = null;  // the served model's /v1/models entry
let pending = [];  // data URLs of the images for the next message
let controller = null;  // the request under way, to abort with Stop

function load() {
  const empty = {system: "", temperature: "", top_p: "", max_tokens: "", messages: []};
  try {
    return {...empty, ...JSON.parse(localStorage.getItem(STORE))};
  } catch {
    return empty;
  }
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(chat));
  } catch (e) {
    showError(`this conversation is too large to keep across reloads (${e.name}); start a new one to keep it again`);
  }
}

function showError(line) {
  $("error").textContent = line;
  $("error").hidden = !line;
}

function authorized(headers = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? {...headers, Authorization: `Bearer ${key}`} : headers;
}

async function errorLine(response) {
  let message = response.statusText;
  try {
    message = (await response.json()).error.message;
  } catch {}
  return `Error ${response.status}: ${message}`;
}

async function connect() {
  const response = await fetch("v1/models", {headers: authorized()}).catch((e) => e);
  model = null;
  $("model").textContent = "not connected";
  if (!(response instanceof Response)) return showError(`the server cannot be reached (${response.message})`);
  $("keybar").hidden = response.status !== 401;
  if (!response.ok) return showError(await errorLine(response));
  model = (await response.json()).data[0];
  $("model").textContent = model.id;
  $("context").textContent = `context ${model.max_model_len} tokens`;
  showError("");
}

// ---- Markdown, as DOM nodes: code blocks, headings, lists, paragraphs; inline code, bold, italics, links

function el(parent, tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (cls) node.className = cls;
  parent.append(node);
  return node;
}

const INLINE = /(`+)([^`]+?)\1|\*\*(.+?)\*\*|(?<![\w*])\*(?!\s)(.+?)\*|\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g;

function inline(parent, text) {
  let at = 0;
  for (const m of text.matchAll(INLINE)) {
    parent.append(text.slice(at, m.index));
    at = m.index + m[0].length;
    if (m[2] !== undefined) el(parent, "code", m[2]);
    else if (m[3] !== undefined) inline(el(parent, "strong"), m[3]);
    else if (m[4] !== undefined) inline(el(parent, "em"), m[4]);
    else Object.assign(el(parent, "a", m[5]), {href: m[6], target: "_blank", rel: "noopener noreferrer"});
  }
  parent.append(text.slice(at));
}

function markdown(parent, text) {
  let code = null, block = null;  // the open code block; the open paragraph or list
  for (const line of text.split("\n")) {
    const fence = /^\s*```/.test(line);
    if (code) {
      if (fence) code = null;
      else code.append(code.childNodes.length ? "\n" + line : line);
      continue;
    }
    const heading = /^(#{1,4})\s+(.*)/.exec(line), item = /^\s*([-*+]|\d+[.)])\s+(.*)/.exec(line);
    if (fence) {
      code = el(el(parent, "pre"), "code");
      block = null;
    } else if (!line.trim()) {
      block = null;
    } else if (heading) {
      inline(el(parent, "h" + heading[1].length), heading[2]);
      block = null;
    } else if (item) {
      const tag = /\d/.test(item[1]) ? "OL" : "UL";
      if (block?.tagName !== tag) block = el(parent, tag);
      inline(el(block, "li"), item[2]);
    } else if (block?.tagName === "P") {
      block.append(document.createElement("br"));
      inline(block, line);
    } else {
      block = el(parent, "p");
      inline(block, line);
    }
  }
}

// ---- the conversation

function stats(m) {
  if (m.error) return "failed";
  const parts = m.stopped ? ["stopped"] : [];
  if (m.tokens) parts.push(`${m.tokens} tokens`);
  const rate = (m.tokens - 1) / (m.last - m.first) * 1000;  // after the first token
  if (m.tokens > 1 && m.last > m.first) parts.push(`${rate.toFixed(1)} tokens/s`);
  if (m.first !== undefined) parts.push(`first token in ${Math.round(m.first)} ms`);
  return parts.join(" · ");
}

function renderMessage(m, node) {
  node.replaceChildren();
  node.className = `msg ${m.role}`;
  for (const url of m.images || []) Object.assign(el(node, "img"), {src: url, alt: "image"});
  markdown(el(node, "div", undefined, "body"), m.content);
  if (m.role === "assistant" && (m.done || m.stopped || m.error)) el(node, "div", stats(m), "stats");
}

function render() {
  const box = $("messages");
  box.replaceChildren();
  for (const m of chat.messages) renderMessage(m, el(box, "div"));
  box.scrollTop = box.scrollHeight;
}

function renderLast() {
  const box = $("messages"), stuck = box.scrollTop + box.clientHeight >= box.scrollHeight - 40;
  renderMessage(chat.messages.at(-1), box.lastElementChild);
  if (stuck) box.scrollTop = box.scrollHeight;
}

function renderPending() {
  $("images").replaceChildren();
  for (const url of pending) {
    Object.assign(el($("images"), "img"), {src: url, alt: "image to send", title: "click to remove"});
  }
}

function apiMessages() {
  const out = chat.system.trim() ? [{role: "system", content: chat.system}] : [];
  for (const m of chat.messages) {
    if (m.error) continue;
    const images = (m.images || []).map((url) => ({type: "image_url", image_url: {url}}));
    const text = m.content ? [{type: "text", text: m.content}] : [];
    out.push({role: m.role, content: images.length ? [...images, ...text] : m.content});
  }
  return out;
}

// Server-sent events: each `data: ...` line's JSON, until [DONE].
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("input").disabled = on;
}

async function send() {
  const text = $("input").value.trim();
  if (controller || (!text && !pending.length)) return;
  if (!model) return connect();
  const user = {role: "user", content: text, images: pending};
  const answer = {role: "assistant", content: ""};
  chat.messages.push(user, answer);
  $("input").value = "";
  pending = [];
  renderPending();
  render();
  showError("");
  const body = {model: model.id, messages: apiMessages().slice(0, -1), stream: true,
                stream_options: {include_usage: true}};
  for (const k of ["temperature", "top_p", "max_tokens"]) if (chat[k] !== "") body[k] = Number(chat[k]);
  controller = new AbortController();
  busy(true);
  const start = performance.now(), since = () => performance.now() - start;
  try {
    const response = await fetch("v1/chat/completions", {method: "POST", body: JSON.stringify(body),
      headers: authorized({"Content-Type": "application/json"}), signal: controller.signal});
    if (!response.ok) throw new Error(await errorLine(response));
    for await (const event of events(response.body)) {
      if (event.error) throw new Error(`the answer stopped with an error: ${event.error.message}`);
      const choice = event.choices?.[0];
      if (choice?.delta?.content) {
        answer.first ??= since();
        answer.last = since();
        answer.content += choice.delta.content;
        renderLast();
      }
      if (event.usage) answer.tokens = event.usage.completion_tokens;
    }
    answer.done = true;
  } catch (e) {
    if (e.name === "TypeError") e.message = `the server cannot be reached (${e.message})`;
    if (!answer.content) {  // nothing came: the message goes back to the box, to fix (or stop) and send again
      chat.messages = chat.messages.filter((m) => m !== user && m !== answer);
      $("input").value = text;
      pending = user.images;
      renderPending();
      if (e.name !== "AbortError") showError(e.message);
    } else if (e.name === "AbortError") {
      answer.stopped = true;
    } else {  // shown, but left out of the conversation the model sees
      user.error = answer.error = true;
      showError(e.message);
    }
  }
  controller = null;
  busy(false);
  render();
  save();
  $("input").focus();
}

async function addImages(files) {
  const images = [...files].filter((f) => f.type.startsWith("image/"));
  if (!images.length) return;
  if (model && !model.images) return showError(`Images cannot be sent: ${model.images_refused}`);
  const read = (file) => new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
  pending.push(...await Promise.all(images.map(read)));
  renderPending();
}

function start() {
  for (const k of FIELDS) {
    $(k).value = chat[k];
    $(k).addEventListener("input", () => { chat[k] = $(k).value; save(); });
  }
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("new").addEventListener("click", () => {
    controller?.abort();
    chat.messages = [];
    save();
    render();
    showError("");
  });
  $("file").addEventListener("change", async () => { await addImages($("file").files); $("file").value = ""; });
  document.addEventListener("paste", (e) => addImages(e.clipboardData?.files || []));
  $("images").addEventListener("click", (e) => {
    const i = [...$("images").children].indexOf(e.target);
    if (i >= 0) { pending.splice(i, 1); renderPending(); }
  });
  $("keybar").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    showError("");
    connect();
  });
  render();
  connect();
}

start();
