// A websocket under /ws/: JSON text frames, and binary frames holding zlib-compressed
// JSON (deltas and snapshots, docs/live-protocol.md). Messages are handled strictly one
// after the other, in arrival order (inflating is asynchronous), and the socket
// reconnects with a growing delay when it drops. A page that sees its data go stale on an
// open socket calls reconnect(); the delay then keeps growing until it calls healthy().

async function inflate(buffer) {
  const stream = new Blob([buffer]).stream().pipeThrough(new DecompressionStream("deflate"));
  return JSON.parse(await new Response(stream).text());
}

export class LiveSocket {
  constructor(path, { onOpen, onMessage, onStatus }) {
    this.url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}${path}`;
    this.onOpen = onOpen;
    this.onMessage = onMessage;
    this.onStatus = onStatus || (() => {});
    this.queue = Promise.resolve();
    this.retryMs = 500;
    this.stale = false;  // the last reconnect was the page's: keep backing off until healthy()
    this.reconnects = 0;
    this.bytes = 0;  // received, as sent on the wire (compressed for binary frames)
    this.frames = 0;
    this.closedByUs = false;
    this.connect();
  }

  connect() {
    const ws = new WebSocket(this.url);
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    this.onStatus("connecting");
    ws.onopen = () => {
      if (!this.stale) this.retryMs = 500;
      this.onStatus("live");
      this.onOpen?.();
    };
    ws.onmessage = (event) => {
      const binary = typeof event.data !== "string";
      const size = binary ? event.data.byteLength : event.data.length;
      this.bytes += size;
      this.frames += 1;
      const received = performance.now();
      this.queue = this.queue.then(async () => {
        const message = binary ? await inflate(event.data) : JSON.parse(event.data);
        await this.onMessage(message, { binary, size, received });
      }).catch((e) => console.error("kvops: a message could not be handled", e));
    };
    ws.onclose = (event) => {
      if (this.closedByUs) return;
      // 4401: not logged in, 4404: no such engine/job. Retrying will not help.
      if (event.code === 4401 || event.code === 4404) {
        this.onStatus(event.code === 4401 ? "log in again" : "not found");
        return;
      }
      this.onStatus("offline");
      this.later();
    };
  }

  later() {
    this.reconnects += 1;
    setTimeout(() => this.connect(), this.retryMs);
    this.retryMs = Math.min(this.retryMs * 2, 10000);
  }

  // Drop this connection (no message of it is handled after this) and open another after
  // the current delay, from onclose.
  reconnect() {
    this.stale = true;
    this.ws.close();
  }

  // The page got fresh data: the next drop is retried quickly again.
  healthy() {
    this.stale = false;
    this.retryMs = 500;
  }

  get open() { return this.ws.readyState === WebSocket.OPEN; }

  send(message) {
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(message));
  }

  close() { this.closedByUs = true; this.ws.close(); }
}
