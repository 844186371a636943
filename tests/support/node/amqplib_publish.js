// Node's amqplib as a publisher rabbit-retry did not write (test-only): publishes one message
// with a header of every AMQP field type amqplib can write, confirmed, and prints the headers
// table exactly as amqplib encoded it (hex).
//
//   NODE_PATH=DIR/node_modules node amqplib_publish.js URL EXCHANGE ROUTING_KEY MESSAGE_ID BODY_HEX
"use strict";
const path = require("node:path");
const amqp = require("amqplib");
// The codec is not among the package's exports: reached by its file, beside the entry point.
const { encodeTable } = require(path.join(path.dirname(require.resolve("amqplib")), "lib", "codec.js"));

const [url, exchange, routingKey, messageId, bodyHex] = process.argv.slice(2);
const typed = (type, value) => ({ "!": type, value });
const headers = {
  int8: typed("int8", -5),
  uint8: typed("uint8", 200),
  int16: typed("int16", 5),
  uint16: typed("uint16", 65000),
  int32: typed("int32", 5),
  uint32: typed("uint32", 4000000000),
  int64: typed("int64", 42),
  float: typed("float", 0.5),
  double: typed("double", 0.1),
  decimal: typed("decimal", { places: 2, digits: 1250 }),
  timestamp: typed("timestamp", 1700000000),
  string: "h\u00e9llo",
  bytes: Buffer.from([0xff, 0x00, 0xfe]),
  bool: true,
  void: null,
  number: 5, // a JavaScript number: amqplib picks the smallest signed type
  big: 2 ** 40,
  fraction: 1.25,
  array: [1, "two", typed("float", 1.5), typed("uint32", 7)],
  table: { nested: typed("uint16", 7), list: [], deeper: { x: typed("int32", -1) } },
};

(async () => {
  const connection = await amqp.connect(url);
  const channel = await connection.createConfirmChannel();
  const buffer = Buffer.alloc(65536);
  const size = encodeTable(buffer, headers, 0);
  channel.publish(exchange, routingKey, Buffer.from(bodyHex, "hex"), {
    headers, messageId, persistent: true, mandatory: true,
  });
  await channel.waitForConfirms();
  await connection.close();
  process.stdout.write(`${buffer.subarray(0, size).toString("hex")}\n`);
})().catch((error) => {
  process.stderr.write(`${error.stack || error}\n`);
  process.exit(1);
});
