//! The extraction-like workload of `bench throughput --workload extract`: synthetic invoices
//! of a chosen length, each different, and a schema whose answers run to about 100 tokens.

use serde_json::{json, Value};

use crate::tokenizer::Tokenizer;

/// Vendor, customer, date, currency, up to three line items and the total: 100 to 140 tokens
/// of compact JSON when filled.
pub fn invoice_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "invoice_number": {"type": "string", "maxLength": 20},
            "vendor": {"type": "string", "maxLength": 40},
            "customer": {"type": "string", "maxLength": 40},
            "date": {"type": "string", "format": "date"},
            "currency": {"enum": ["USD", "EUR", "GBP"]},
            "lines": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "item": {"type": "string", "maxLength": 30},
                        "quantity": {"type": "integer", "minimum": 1},
                        "amount": {"type": "number"}
                    },
                    "required": ["item", "quantity", "amount"],
                    "additionalProperties": false
                }
            },
            "total": {"type": "number", "minimum": 0}
        },
        "required": ["invoice_number", "vendor", "customer", "date", "currency", "lines", "total"],
        "additionalProperties": false
    })
}

const VENDORS: [&str; 8] = [
    "Northwind Traders",
    "Contoso Supplies",
    "Fabrikam Industrial",
    "Tailspin Logistics",
    "Litware Components",
    "Adventure Works Outfitters",
    "Proseware Office",
    "Wingtip Hardware",
];
const CUSTOMERS: [&str; 6] = [
    "Globex Corporation",
    "Initech LLC",
    "Umbrella Retail",
    "Hooli Europe GmbH",
    "Stark Fabrication",
    "Wayne Shipping",
];
const ITEMS: [&str; 12] = [
    "Steel brackets",
    "Copper wire, 50 m",
    "Safety gloves",
    "Pallet wrap",
    "Hex bolts M8",
    "Cable ties",
    "Label printer ribbon",
    "Forklift service",
    "Packing tape",
    "Shelf unit",
    "LED work lamp",
    "Freight surcharge",
];
const NOTES: [&str; 4] = [
    "Goods remain the property of the vendor until paid in full. Late payments incur interest at 1.5% per month.",
    "Please quote the invoice number on your remittance. Bank transfer details are printed on the reverse.",
    "Deliveries were made to the loading dock on the east side of the warehouse, signed for by the night shift.",
    "Any discrepancy must be reported within 14 days of receipt, with photographs of damaged items attached.",
];

/// Invoice number `seed`, padded with remarks until it is at least `tokens` tokens long.
pub fn invoice_document(tokenizer: &Tokenizer, seed: usize, tokens: usize) -> anyhow::Result<String> {
    let pick = |list: &[&'static str], k: usize| list[(seed * 7 + k * 3) % list.len()];
    let currency = ["USD", "EUR", "GBP"][seed % 3];
    let month = 1 + seed % 12;
    let mut doc = format!(
        "INVOICE INV-{:05}\nVendor: {}\nBill to: {}\nDate: 2025-{month:02}-{:02}\nDue: 2025-{month:02}-28\n\n",
        1000 + seed * 37,
        pick(&VENDORS, 0),
        pick(&CUSTOMERS, 1),
        1 + seed % 20,
    );
    let mut total = 0.0;
    let num_lines = 2 + seed % 4;
    for k in 0..num_lines {
        let quantity = 1 + (seed + k) % 9;
        let price = 3.5 + ((seed * 13 + k * 29) % 400) as f64 / 4.0;
        total += quantity as f64 * price;
        doc.push_str(&format!(
            "{quantity} x {} @ {price:.2} = {:.2} {currency}\n",
            pick(&ITEMS, k),
            quantity as f64 * price
        ));
    }
    doc.push_str(&format!("\nTOTAL DUE: {total:.2} {currency}\n\nRemarks:\n"));
    let mut k = 0;
    while tokenizer.encode_fragment(&doc, false)?.len() < tokens {
        doc.push_str(pick(&NOTES, k));
        doc.push(if k % 2 == 0 { ' ' } else { '\n' });
        k += 1;
    }
    Ok(doc)
}
