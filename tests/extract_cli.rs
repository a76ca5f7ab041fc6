//! `quarry extract` end to end with the real model: the ready-made invoice schema on a sample
//! document prints one object that validates; a schema that cannot compile is refused by name.

mod common;

use std::process::Command;

fn extract(schema: &str, document: &str) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_quarry"))
        .args([
            "extract",
            "--schema",
            schema,
            "--document",
            document,
            "--max-tokens",
            "256",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        stderr,
    )
}

#[test]
fn the_invoice_schema_on_a_sample_document_validates() {
    if common::model_path().is_none() {
        return;
    }
    let (ok, stdout, stderr) = extract("schemas/invoice.json", "examples/documents/invoice.txt");
    assert!(ok, "{stderr}");
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{}/schemas/invoice.json", env!("CARGO_MANIFEST_DIR"))).unwrap(),
    )
    .unwrap();
    let value: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(jsonschema::validator_for(&schema).unwrap().is_valid(&value), "{value}");
    assert!(stderr.contains("outcome: ok"), "{stderr}");

    let broken = std::env::temp_dir().join(format!("quarry-broken-{}.json", std::process::id()));
    std::fs::write(
        &broken,
        r##"{"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}"##,
    )
    .unwrap();
    let (ok, stdout, stderr) = extract(broken.to_str().unwrap(), "examples/documents/invoice.txt");
    assert!(
        !ok && stdout.is_empty() && stderr.contains("schema_rejected") && stderr.contains("$ref"),
        "{stderr}"
    );
    std::fs::remove_file(broken).ok();
}

/// The leaves of a record (an empty array or object is one), by pointer, sorted.
fn leaf_pointers(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) if !m.is_empty() => {
            for (k, x) in m {
                leaf_pointers(x, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out);
            }
        }
        serde_json::Value::Array(a) if !a.is_empty() => {
            for (i, x) in a.iter().enumerate() {
                leaf_pointers(x, format!("{at}/{i}"), out);
            }
        }
        _ => out.push(at),
    }
}

/// `--confidence` prints one line per leaf of the record on stderr (the record alone stays on
/// stdout), each a probability; in a JSONL batch each ok line carries `fields`, one per leaf.
#[test]
fn confidence_names_every_field_of_the_record() {
    if common::model_path().is_none() {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_quarry"))
        .args([
            "extract",
            "--schema",
            "schemas/contact.json",
            "--document",
            "examples/documents/contact.txt",
            "--confidence",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    let record: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is the record alone");
    let mut want = Vec::new();
    leaf_pointers(&record, String::new(), &mut want);
    let listed: Vec<(f64, String)> = stderr
        .lines()
        .skip_while(|l| !l.starts_with("confidence"))
        .skip(1)
        .filter_map(|l| {
            let (c, p) = l.trim().split_once("  ")?;
            Some((c.trim().parse().ok()?, p.trim().to_string()))
        })
        .collect();
    let mut got: Vec<String> = listed.iter().map(|(_, p)| p.clone()).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "{stderr}");
    assert!(listed.iter().all(|(c, _)| (0.0..=1.0).contains(c)), "{stderr}");

    let dir = std::env::temp_dir().join(format!("quarry-confidence-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("in.jsonl");
    std::fs::write(
        &input,
        "{\"id\": \"a\", \"document\": \"Write to Ana Ruiz at ana@ruiz.example.\"}\n{\"id\": \"b\", \"document\": \"Call Bo Chen on 555 0100.\"}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_quarry"))
        .args(["extract", "--schema", "schemas/contact.json", "--confidence", "--input"])
        .arg(&input)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for line in lines.iter().filter(|l| l["outcome"] == "ok") {
        let mut want = Vec::new();
        leaf_pointers(&line["data"], String::new(), &mut want);
        let mut got: Vec<String> = line["fields"]
            .as_array()
            .expect("fields with --confidence")
            .iter()
            .map(|f| f["pointer"].as_str().unwrap().to_string())
            .collect();
        got.sort();
        want.sort();
        assert_eq!(got, want, "{line}");
    }

    // CSV output: a confidence column after each column, the JSONL run's values (greedy, so
    // the same records) to three places.
    let csv_out = dir.join("out.csv");
    let out = Command::new(env!("CARGO_BIN_EXE_quarry"))
        .args(["extract", "--schema", "schemas/contact.json", "--confidence", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&csv_out)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut reader = csv::Reader::from_path(&csv_out).unwrap();
    let header: Vec<String> = reader.headers().unwrap().iter().map(str::to_string).collect();
    let columns = ["name", "email", "phone", "company"];
    let mut want_header = vec!["id".to_string(), "outcome".into()];
    for c in columns {
        want_header.extend([c.to_string(), format!("{c}__confidence")]);
    }
    want_header.push("error".into());
    assert_eq!(header, want_header);
    for (row, line) in reader.records().map(Result::unwrap).zip(&lines) {
        for (k, c) in columns.iter().enumerate() {
            let want = line["fields"]
                .as_array()
                .and_then(|f| f.iter().find(|f| f["pointer"] == format!("/{c}").as_str()))
                .and_then(|f| f["confidence"].as_f64())
                .map(|c| format!("{c:.3}"))
                .unwrap_or_default();
            assert_eq!(&row[3 + 2 * k], want, "{c}: {row:?} against {line}");
        }
    }
    std::fs::remove_dir_all(dir).ok();
}
