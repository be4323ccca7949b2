// Drives the upload page in Debian's chromium (headless, through playwright-core): uploads
// the files given, waits for the results, checks keyboard reach and that no request
// leaves the machine, and saves screenshots. Prints what the page shows as JSON.
// Usage: [MANY_DIR=dir] node upload.mjs BASE_URL ARTIFACT_DIR FILE...
import { chromium } from "playwright-core";

const [base, artifacts, ...files] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-background-networking", "--disable-component-update",
         "--disable-default-apps", "--disable-sync", "--no-first-run", "--disable-gpu"],
});
const out = { outside: [], consoleErrors: [] };
try {
  const page = await browser.newPage({ viewport: { width: 1200, height: 900 } });
  const local = new URL(base).host;
  page.on("request", (r) => {
    const u = new URL(r.url());
    if (u.protocol.startsWith("http") && u.host !== local) out.outside.push(r.url());
  });
  page.on("console", (m) => { if (m.type() === "error") out.consoleErrors.push(m.text()); });
  page.on("pageerror", (e) => out.consoleErrors.push(String(e)));
  await page.goto(`${base}/`);

  await page.setInputFiles("#files", files);
  out.chosen = await page.textContent("#chosen");
  // Keyboard: from the top of the page, Tab reaches the file chooser, the options and
  // the button; Enter on the button classifies.
  const reached = [];
  for (let i = 0; i < 6 && !reached.includes("classify"); i++) {
    await page.keyboard.press("Tab");
    reached.push(await page.evaluate(() => document.activeElement.id || document.activeElement.tagName));
  }
  out.tabOrder = reached;
  await page.keyboard.press("Enter");
  await page.waitForSelector("#summary:not([hidden])", { timeout: 120_000 });
  out.status = await page.textContent("#status");
  out.summary = await page.$$eval("#summary li", (lis) => lis.map((li) => li.textContent.trim()));
  out.cards = await page.$$eval("#results > li", (lis) => lis.map((li) => ({
    filename: li.querySelector("h2").textContent,
    label: li.querySelector(".top1 .label")?.textContent ?? null,
    score: li.querySelector(".top1 .score")?.textContent ?? null,
    bars: li.querySelectorAll(".bars > li").length,
    problem: li.querySelector(".problem")?.textContent ?? null,
    thumbnailLoaded: !!li.querySelector("img") && li.querySelector("img").complete
      && li.querySelector("img").naturalWidth > 0,
    fullLabel: li.querySelector(".top1 .label")?.title ?? null,
  })));
  await page.screenshot({ path: `${artifacts}/upload-page.png`, fullPage: true });
  await page.setViewportSize({ width: 390, height: 844 });
  out.phoneOverflow = await page.evaluate(() => document.documentElement.scrollWidth > window.innerWidth);
  await page.screenshot({ path: `${artifacts}/upload-page-phone.png` });

  // Many files at once (MANY_DIR: a directory of images, e.g. 1000 of them).
  if (process.env.MANY_DIR) {
    const { readdirSync } = await import("node:fs");
    const many = readdirSync(process.env.MANY_DIR).sort().map((n) => `${process.env.MANY_DIR}/${n}`);
    await page.setViewportSize({ width: 1200, height: 900 });
    await page.goto(`${base}/`);
    await page.setInputFiles("#files", many);
    const started = Date.now();
    await page.getByRole("button", { name: "Classify" }).click();
    await page.waitForSelector("#summary:not([hidden])", { timeout: 600_000 });
    out.many = {
      chosen: await page.textContent("#chosen"),
      cards: await page.$$eval("#results > li", (lis) => lis.length),
      failed: await page.$$eval("#results > li.failed", (lis) => lis.length),
      labels: await page.$$eval("#results .top1 .label", (els) => els.slice(0, 3).map((e) => e.textContent)),
      summary: await page.$$eval("#summary li", (lis) => lis.map((li) => li.textContent.trim())),
      seconds: (Date.now() - started) / 1000,
    };
  }

  // /docs: Swagger UI renders the document, from this server alone.
  await page.setViewportSize({ width: 1200, height: 900 });
  await page.goto(`${base}/docs`);
  await page.waitForSelector(".swagger-ui .info .title", { timeout: 60_000 });
  out.docsTitle = (await page.textContent(".swagger-ui .info .title")).trim();
  out.docsOperations = await page.$$eval(".opblock-summary-path", (els) => els.length);
  await page.screenshot({ path: `${artifacts}/docs.png` });
} catch (e) {
  out.failure = String(e);
  const pages = browser.contexts().flatMap((c) => c.pages());
  if (pages.length) out.statusAtFailure = await pages[0].textContent("#status").catch(() => null);
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
process.exitCode = out.failure ? 1 : 0;
