//! Per-field confidence is the model's, not the engine's: greedy, with jump-forward on (the
//! grammar's forced tokens appended without a model step) and off (drawn from masks of one
//! choice), every extraction gives the same record and the same confidence per field.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use quarry::engine::{EngineClient, EngineConfig, EngineCore};
use quarry::extract::{Extractor, Outcome, Task};
use serde_json::{json, Value};

fn documents() -> Vec<(Value, String)> {
    let contact = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "email": {"type": ["string", "null"]},
            "phone": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
        },
        "required": ["name", "email", "tags"]
    });
    let invoice: Value =
        serde_json::from_str(include_str!("../schemas/invoice.json")).expect("schemas/invoice.json is JSON");
    vec![
        (
            contact.clone(),
            "Call Dr. Wei Zhang (Umbrella Labs) on +44 20 7946 0018 or write to wei.zhang@umbrella.example.".into(),
        ),
        (
            contact,
            "Met Ana at the fair; she sells pottery and teaches glazing.".into(),
        ),
        (invoice, include_str!("../examples/documents/invoice.txt").into()),
    ]
}

/// A record and its fields' confidence, by pointer.
type Scored = (Value, BTreeMap<String, f64>);

/// Each document's record and its fields' confidence.
fn extract(core: EngineCore, tok: &Arc<quarry::tokenizer::Tokenizer>) -> (Vec<Scored>, EngineCore) {
    let extractor = Arc::new(Extractor::new(EngineClient::start(core), tok.clone()));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut out = Vec::new();
    for (schema, document) in documents() {
        let x = runtime
            .block_on(extractor.run(Task::new(schema, document)))
            .expect("extraction runs");
        assert_eq!(x.outcome, Outcome::Ok, "{}", x.text);
        let fields = x
            .fields
            .iter()
            .map(|f| {
                let c = f.confidence().expect("computed on the host");
                (f.pointer.clone(), c)
            })
            .collect();
        out.push((x.data.expect("ok has data"), fields));
    }
    let core = extractor.client.shutdown().expect("the engine hands its core back");
    (out, core)
}

#[test]
fn confidence_is_the_same_with_jump_forward_on_and_off() {
    let Some((backend, tok)) = common::load_backend(8192) else {
        return;
    };
    let tok = Arc::new(tok);
    let on = EngineConfig::default();
    assert!(on.jump_forward, "jump-forward is the default");
    let (with, core) = extract(EngineCore::new(backend, tok.clone(), on), &tok);
    let off = EngineConfig {
        jump_forward: false,
        ..on
    };
    let (without, _) = extract(EngineCore::new(core.into_backend(), tok.clone(), off), &tok);
    let mut compared = 0;
    for ((data_on, conf_on), (data_off, conf_off)) in with.iter().zip(&without) {
        assert_eq!(data_on, data_off, "the record depends on jump-forward");
        assert_eq!(conf_on.keys().collect::<Vec<_>>(), conf_off.keys().collect::<Vec<_>>());
        for (pointer, a) in conf_on {
            let b = conf_off[pointer];
            assert!(
                (a - b).abs() <= 1e-4 * a.max(b).max(1e-6),
                "{pointer}: {a} with jump-forward, {b} without"
            );
            compared += 1;
        }
    }
    assert!(compared >= 10, "only {compared} fields compared");
    // Some field is uncertain: the check is not vacuous over confidences of 1.
    assert!(with.iter().any(|(_, c)| c.values().any(|&v| v < 0.99)), "{with:?}");
}
